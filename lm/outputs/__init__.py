"""The output layers, one module per strategy. Each gets the context vectors r (N, E) that
``NeuralLM.encode`` makes, and beside them the context ids ctx (N, order-1), which only the
direct n-gram features read; each owns its parameters, its training scores, its exact
log-probability with its normalisers, its initialisation, its chunking for exact scoring and,
where it has them, its fast CPU inference tables:

=================  ==================  =====================================================
``ClassOutput``    ``class_factored``  class-factored (Goodman 2001; Mikolov et al. 2011; OxLM,
                                       Baltescu & Blunsom 2015), with OxLM's direct n-gram
                                       features
``SoftmaxOutput``  ``softmax``         the full softmax (the baseline)
``BandedOutput``   ``banded``          the differentiated softmax (Chen, Grangier & Auli 2016)
``TreeOutput``     ``tree``            a binary tree over the words (Morin & Bengio 2005; Mnih
                                       & Hinton 2008)
=================  ==================  =====================================================

``base`` holds what they share: :class:`OutputLayer` (what every layer answers) and
:class:`SoftmaxFamily` (a score per word normalised over all V words). Everything imports from the
modules; the package itself names nothing.
"""
