from recipes.clip.train import main
from recipes.flamingo import RECIPE

if __name__ == "__main__":
    main(RECIPE)
