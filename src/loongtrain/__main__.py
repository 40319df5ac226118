from loongtrain.cli import main

main()
