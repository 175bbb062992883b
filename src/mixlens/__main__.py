from mixlens.cli import main

main()
