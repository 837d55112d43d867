"""The engine, split by process: :mod:`weft.engine.api` serves callers (API server, ``LLM``) and never imports
torch; :mod:`weft.engine.core` steps the scheduler and the executor; :mod:`weft.engine.messages` is what
crosses between them and :mod:`weft.engine.client` how."""
