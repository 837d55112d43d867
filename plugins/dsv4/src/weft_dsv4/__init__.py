"""weft-dsv4: the DeepSeek V4 / V4.1 model family for Weft.

``model``            the ``DeepseekV4ForCausalLM`` family (decoder stack, KV-cache groups, weight loading)
``config``           the validated ``config.json`` numbers and layer types
``rope``             partial interleaved RoPE, YaRN on the compressed branches
``norm``             the fp32-weighted and the weightless RMSNorm
``compressor``       pools ``m`` tokens into one compressed entry; its partial window is recurrent state
``indexer``          the lightning indexer's scores of CSA entries
``attention``        window ring + compressed entries + sink attention, grouped low-rank output
``mhc``              hyper-connections (Sinkhorn-normalised stream mixing)
``moe``              router, routed experts, shared expert
``weights``          checkpoint tensor names <-> parameters, one map read both ways
``step``             a step's requests as the layers read them
``chat``             V4.1 chat-message normalisation and the ``dsv4`` tokenizer
``parsers``          the ``dsv4`` tool and reasoning parsers
``mm``               V4.1's image token stream: the ``dsv4`` multimodal processor
``parallel``         the draft model's parallel config, derived from the target's
``mtp``              the checkpoint's multi-token-prediction layers as the ``mtp`` speculator
``reference``        transformers as a correctness reference, and a direct driver of the module
``tiny_checkpoint``  writes a tiny random DeepSeek V4 checkpoint folder
"""
