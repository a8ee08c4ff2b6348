"""Moses side: n-best lists, rescoring, MERT, BLEU; the C++ NeuralLMServer feature in cpp/."""
