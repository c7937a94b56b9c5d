"""The predictor (``stnb.scaling``) checked on published tables it was not built from, and its CLI.

    seed    the sentence-transformers docs' 4x V100 rows, as the predictor's inputs with their ranges
    dle     NVIDIA DeepLearningExamples' BERT-large fine-tuning on a DGX-1
    check   both tables predicted row by row as intervals (``python -m stnblab.scaling.check``)
    onerank a one-rank FSDP run of a configuration (``stnb.predict(..., one_rank=)``: FSDP's host work per collective)
    cli     ``python -m stnb predict``
"""
