"""Moses side: n-best lists, rescoring, MERT, BLEU; the C++ NeuralLMServer feature in cpp/.

Import path: ``nlmserve.moses_plugin`` (folder ``moses_plugin/``).
"""
