from recipes.align import RECIPE
from recipes.clip.train import main

if __name__ == "__main__":
    main(RECIPE)
