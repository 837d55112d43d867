"""Vision-language model families and their multimodal processors (docs/multimodal.md).

Each family implements :class:`weft.contracts.model.ModelFamily` with :meth:`encode` (its vision tower
and projector); each processor implements :class:`weft.contracts.mm_processor.MMProcessor` (placeholder
expansion, encoder inputs, item hashes) in the API process, without torch.
"""
