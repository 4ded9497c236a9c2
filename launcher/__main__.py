from launcher.cli import main

main(prog_name="python -m launcher")
