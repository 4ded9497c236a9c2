from glm53.apibench.cli import main

main(prog_name="python -m glm53.apibench")
