"""The model: corpus, vocabulary, word classes, neural LM, training, evaluation, model files."""
