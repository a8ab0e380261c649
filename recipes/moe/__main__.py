from recipes.moe.train import main

main()
