from aserve.cli import main

main()
