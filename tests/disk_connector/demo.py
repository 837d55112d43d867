"""Run twice: the second process loads the blocks the first one saved, and answers the same."""

import sys

from weft import LLM, SamplingParams

model, blocks = sys.argv[1], sys.argv[2]
document = " ".join(f"Clause {n}: the tenant keeps the garden tidy and pays on day {n}." for n in range(1, 9))
with LLM(model=model, use={"kv_connector": "disk"}, plugins={"disk": {"path": blocks}}) as llm:
    output = llm.generate(
        document + " Question: what does the tenant keep tidy? Answer:", SamplingParams(temperature=0, max_tokens=12)
    )[0]
print(
    f"{output.num_cached_tokens} of {len(output.prompt_token_ids)} prompt tokens loaded; answer: "
    f"{output.outputs[0].text!r}"
)
