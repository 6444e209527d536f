import sys
from pathlib import Path

# the tests' helpers (tiny models, tiny tokenizer) import as top-level modules
sys.path.insert(0, str(Path(__file__).parent))
