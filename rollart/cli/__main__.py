from rollart.cli import main

main()
