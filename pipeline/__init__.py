"""batchgen: batch generation that prefills each shared token prefix once."""

__version__ = "0.1.0"
