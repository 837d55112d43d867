"""What a user runs: the Python LLM class (``llm``), ``weft serve`` (``serve``) and, on a node other than
node 0, the launcher of that node's workers (``node``)."""
