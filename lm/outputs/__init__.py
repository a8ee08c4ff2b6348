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
:class:`SoftmaxFamily` (a score per word normalised over all V words). The package names the
layers and the direct features' hash constants (``nlmserve.wire.ngrams``'s) that the fused
training step reads; the rest of ``lm/`` imports from the modules.
"""

from .banded import BandedOutput as BandedOutput
from .base import OutputLayer as OutputLayer, SoftmaxFamily as SoftmaxFamily
from .class_factored import ClassOutput as ClassOutput
from .class_factored import HASH_CTX as HASH_CTX, HASH_KEY as HASH_KEY, HASH_MOD as HASH_MOD
from .class_factored import HASH_OUT as HASH_OUT, HASH_SEED as HASH_SEED
from .softmax import SoftmaxOutput as SoftmaxOutput
from .tree import TreeOutput as TreeOutput
