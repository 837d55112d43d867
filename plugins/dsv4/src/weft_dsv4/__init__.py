"""weft-dsv4: the DeepSeek V4 / V4.1 model family for Weft.

``model``            the ``DeepseekV4ForCausalLM`` family and its five KV-cache groups
``chat``             V4.1 chat-message normalisation
``parallel``         the draft model's parallel config, derived from the target's
``tiny_checkpoint``  writes a tiny random DeepSeek V4 checkpoint folder
"""
