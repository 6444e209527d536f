from pipeline.cli import script

script()
