"""Tensor- and sequence-parallel layer math: the conjugate collective pairs (``tp_comm``), column/row-parallel
linears (``tensor_parallel``), the vocabulary-parallel embedding and loss (``tp_vocab``), and the sequence-parallel
attentions (``sequence_parallel``: Megatron-SP helpers, ring attention, Ulysses; ``sp_ring``: the ring's blocks),
and the split backward the zero-bubble pipeline schedules run (``split_backward``: input gradients in B, weight
gradients deferred to W).

Imports torch only: never Lightning or DeepSpeed (a test checks it).
"""
