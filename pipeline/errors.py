"""The base class of batchgen's errors, for pipeline code and callers that catch them all.

It lives in jobs/errors.py, the lowest layer (jobs/ never imports pipeline/); every error class
of pipeline/ (ModelLoadError, TokenizerError, EngineError, GrammarError) subclasses it, so the
CLI catches exactly batchgen's own errors and a bug still shows its traceback."""
from batchgen.jobs.errors import BatchgenError, OptionError, option

__all__ = ["BatchgenError", "OptionError", "option"]
