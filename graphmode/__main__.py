from graphmode.cli import main

main()
