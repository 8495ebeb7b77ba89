"""Rewrites of the exported graph the runtime serves (before any shape is fixed), each proven or refused.

Unlike the legalization passes, which turn one static-shape graph into PopART's opset 11, these change
what the runtime serves for every shape: a mixture of experts computed densely (``dense_experts``), a
classification head's end-of-sentence selection computed densely (``eos_selection``, under a condition on
the token counts the runtime checks per call), a seq2seq decoder's past made exact on a zero-padded cache
by a mask input (``past_padding_mask``), and raw audio made exact on zero padding by a generated frame
mask (``audio_frame_mask``).
"""
