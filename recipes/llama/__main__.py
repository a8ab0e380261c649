from recipes.llama.train import main

main()
