from recipes.bert.train import main

main()
