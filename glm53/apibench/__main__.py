from apibench.cli import main

main(prog_name="python -m apibench")
