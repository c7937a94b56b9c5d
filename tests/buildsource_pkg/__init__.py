"""A package whose submodules its ``__init__`` does not import (as ``sentence_transformers.losses`` may
not be yet): what ``buildsource.read_objects`` imports itself before reading a build function's objects."""
