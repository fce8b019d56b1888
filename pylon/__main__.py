from pylon.cli import main

main()
