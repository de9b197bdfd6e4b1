from zeroplan.cli import main

main()
