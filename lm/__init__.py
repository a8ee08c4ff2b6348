"""The model: corpus, vocabulary, word classes, neural LM, training, evaluation, model files.

Import path: ``nlmserve.lm`` (folder ``lm/``).
"""
