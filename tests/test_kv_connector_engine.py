"""The engine's side of the KV-connector contract, with a throwaway connector that answers "not yet"."""

from __future__ import annotations

import pytest
from conftest import make_tiny_model

from weft import LLM, SamplingParams

HESITANT = '''
    from weft.contracts.kv_connector import KVConnector

    ASKED = {}


    class HesitantConnector(KVConnector):
        """Answers "ask again later" twice per request, then "nothing to load"."""

        name = "hesitant"

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            ASKED[request.request_id] = ASKED.get(request.request_id, 0) + 1
            return (None, False) if ASKED[request.request_id] <= 2 else (0, False)
'''


@pytest.fixture
def tiny(tmp_path_factory, tokenizer_files):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", tokenizer_files)


def test_a_request_the_connector_cannot_answer_for_yet_is_passed_over_and_asked_again(tiny, site, monkeypatch):
    site.add_distribution(
        "weft-hesitant", entry_points={"weft.kv_connector": {"hesitant": "hesitant:HesitantConnector"}},
        modules={"hesitant": HESITANT},
    )
    monkeypatch.syspath_prepend(str(site.root))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 9, [9, 10, 11] * 7]
    engine = {"num_kv_blocks": 64, "max_model_len": 128}
    expected = [output.outputs[0].token_ids for output in LLM(model=str(tiny), engine=engine).generate(prompts, params)]
    with LLM(model=str(tiny), engine=engine, use={"kv_connector": "hesitant"}) as llm:
        outputs = llm.generate(prompts, params)
    import hesitant

    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert sorted(hesitant.ASKED.values()) == [3, 3]
