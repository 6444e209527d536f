from batchgen.pipeline.cli import script

script()
