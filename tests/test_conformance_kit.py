"""The conformance kit itself: it passes a correct plugin and fails a wrong one."""

from __future__ import annotations

import subprocess
import sys
import textwrap

OPS_MODULE = """
    import torch
    from weft.contracts.ops import OpImplementation

    class ScaleReference(OpImplementation):
        op = "scale"
        reference = True
        priority = -100

        def __call__(self, x):
            return x * 2

        @classmethod
        def example_inputs(cls, device):
            generator = torch.Generator().manual_seed(0)
            for shape in [(3,), (4, 5), (0, 7)]:
                yield (torch.randn(shape, generator=generator, device=device),), {}

    class ScaleFast(OpImplementation):
        op = "scale"
        priority = 10

        def __call__(self, x):
            return x + x

    class ScaleWrong(OpImplementation):
        op = "scale"
        priority = 5

        def __call__(self, x):
            return x * 2 + 1e-3

    class ScaleElsewhere(OpImplementation):
        op = "scale"
        platforms = frozenset({"cuda"})
        priority = 99

        def __call__(self, x):
            raise AssertionError("must not be chosen on the CPU")
"""


def add_ops(site):
    site.add_distribution(
        "weft-scale-ops",
        entry_points={
            "weft.ops": {
                "scale.torch": "scale_ops:ScaleReference",
                "scale.fast": "scale_ops:ScaleFast",
                "scale.wrong": "scale_ops:ScaleWrong",
                "scale.elsewhere": "scale_ops:ScaleElsewhere",
            }
        },
        modules={"scale_ops": OPS_MODULE},
    )


def run_kit(site, tmp_path, body: str, *pytest_args: str) -> subprocess.CompletedProcess[str]:
    test_file = tmp_path / "test_kit_run.py"
    test_file.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file), *pytest_args],
        capture_output=True,
        text=True,
        env=site.env(),
        cwd=tmp_path,
        timeout=300,
    )


def test_op_kit_passes_a_correct_implementation_and_fails_a_wrong_one(site, tmp_path):
    add_ops(site)
    result = run_kit(
        site,
        tmp_path,
        """
        from weft.testing import OpContract

        class TestFast(OpContract):
            plugin_name = "scale.fast"

        class TestWrong(OpContract):
            plugin_name = "scale.wrong"
        """,
    )
    assert "TestWrong::test_matches_the_reference FAILED" in result.stdout or "1 failed" in result.stdout, result.stdout
    assert "FAILED test_kit_run.py::TestWrong::test_matches_the_reference" in result.stdout
    assert "TestFast" not in result.stdout.split("short test summary")[-1]
    assert "1 failed" in result.stdout


def test_tokenizer_kit_fails_a_tokenizer_that_splits_characters(site, tmp_path):
    site.add_distribution(
        "weft-lossy",
        entry_points={"weft.tokenizer": {"lossy": "lossy_tok:Lossy"}},
        modules={
            "lossy_tok": """
                from weft_example_bytes.tokenizer import ByteTokenizer
                from weft.contracts.tokenizer import IncrementalDetokenizer

                class EagerDetokenizer(IncrementalDetokenizer):
                    def push(self, token_id):
                        piece = bytes([token_id]).decode("utf-8", errors="replace") if token_id < 256 else ""
                        self.text += piece
                        return piece

                class Lossy(ByteTokenizer):
                    def detokenizer(self, prompt_token_ids=(), skip_special_tokens=True):
                        return EagerDetokenizer(self, prompt_token_ids, skip_special_tokens)
            """
        },
    )
    result = run_kit(
        site,
        tmp_path,
        """
        import pytest
        from weft.testing import TokenizerContract

        class TestLossy(TokenizerContract):
            plugin_name = "lossy"

            @pytest.fixture
            def tokenizer(self, plugin):
                return plugin.from_source(None)
        """,
    )
    assert "FAILED test_kit_run.py::TestLossy::test_streaming_never_splits_characters" in result.stdout, result.stdout
    assert "1 failed" in result.stdout


def test_choose_op_by_platform_and_priority(site):
    add_ops(site)
    result = site.python(
        """
        from weft.builtins.cpu import CpuPlatform
        from weft.plugins import PluginError, PluginRegistry
        from weft.plugins.selection import choose_op

        registry, cpu = PluginRegistry(), CpuPlatform()
        print(type(choose_op(registry, "scale", cpu)).__name__)
        print(type(choose_op(registry, "scale", cpu, forced="torch")).__name__)
        for forced in ("elsewhere", "missing"):
            try:
                choose_op(registry, "scale", cpu, forced=forced)
            except PluginError as error:
                print(error)
        """
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "ScaleFast"  # highest priority among those that run on the CPU
    assert lines[1] == "ScaleReference"
    assert "use.ops.scale = 'elsewhere': that implementation cannot run on platform 'cpu'" in lines[2]
    assert "no ops plugin named 'scale.missing'" in lines[3]


EAGER_DISK = """
    import msgspec
    from weft_example_disk.connector import DiskConnector

    class EagerDisk(DiskConnector):
        name = "eager"  # registered as "eager-disk"

        def build_connector_meta(self, step):
            # The defect: it takes a prefill chunk for the whole prompt, so it saves blocks not computed yet.
            whole = [
                msgspec.structs.replace(item, num_new_tokens=item.num_new_tokens + 10_000) for item in step.requests
            ]
            return super().build_connector_meta(msgspec.structs.replace(step, requests=tuple(whole)))
"""


def test_kv_connector_kit_fails_a_misnamed_connector_that_saves_blocks_before_they_are_computed(
    site, tmp_path, tokenizer_files
):
    from conftest import make_tiny_model

    model = make_tiny_model(tmp_path / "llama", "llama", tokenizer_files)
    site.add_distribution(
        "weft-eager-disk",
        entry_points={"weft.kv_connector": {"eager-disk": "eager_disk:EagerDisk"}},
        modules={"eager_disk": EAGER_DISK},
    )
    result = run_kit(
        site,
        tmp_path,
        f"""
        import pytest
        from weft.testing import KVConnectorContract

        class TestEagerDisk(KVConnectorContract):
            plugin_name = "eager-disk"

            @pytest.fixture
            def connector_options(self, tmp_path):
                return {{"path": str(tmp_path)}}

            @pytest.fixture
            def model_source(self):
                return {str(model)!r}
        """,
        "-k",
        "named_as_registered or second_engine or chunked",
    )
    summary = result.stdout.split("short test summary")[-1]
    assert "FAILED test_kit_run.py::TestEagerDisk::test_chunked_prefill_saves_and_loads" in summary, result.stdout
    assert "EagerDisk.name is 'eager' but its entry point is 'eager-disk'" in result.stdout
    assert "second_engine" not in summary  # a prompt computed in one step is saved right
    assert "2 failed, 1 passed" in result.stdout


SLOPPY_SPECULATORS = """
    from weft.builtins.ngram_speculator import NgramSpeculator
    from weft.contracts.speculator import Proposals

    class Hoarding(NgramSpeculator):
        '''The defect: it keeps its proposals as if they were all accepted.'''
        name = "hoarding"

        def propose(self, step):
            proposals = super().propose(step)
            self.last = dict(zip(step.request_ids, proposals.token_ids))
            return proposals

        def on_verified(self, results):
            for result in results:
                buffer = self._requests.get(result.request_id)
                if buffer is not None:
                    buffer.extend([*self.last.get(result.request_id, [])[: result.num_proposed], result.token_ids[-1]])

    class Greedy(NgramSpeculator):
        '''The defect: it proposes one token more than asked.'''
        name = "greedy"

        def propose(self, step):
            return Proposals([[*tokens, 0] for tokens in super().propose(step).token_ids])
"""


def test_speculator_kit_fails_one_that_keeps_rejected_proposals_or_proposes_too_many(site, tmp_path):
    site.add_distribution(
        "weft-sloppy-speculators",
        entry_points={"weft.speculator": {"hoarding": "sloppy:Hoarding", "greedy": "sloppy:Greedy"}},
        modules={"sloppy": SLOPPY_SPECULATORS},
    )
    result = run_kit(
        site,
        tmp_path,
        """
        from weft.builtins.ngram_speculator import NgramOptions
        from weft.testing import SpeculatorContract

        class TestHoarding(SpeculatorContract):
            plugin_name = "hoarding"
            options = NgramOptions(prompt_lookup_min=1, prompt_lookup_max=2)

        class TestGreedy(SpeculatorContract):
            plugin_name = "greedy"
        """,
    )
    summary = result.stdout.split("short test summary")[-1]
    assert "TestHoarding::test_told_what_was_accepted_it_proposes_as_for_the_accepted_context" in summary, result.stdout
    assert "TestGreedy::test_proposals_stay_within_what_was_asked_and_the_vocabulary" in summary
    assert "TestHoarding::test_proposals_stay_within" not in summary


SLOPPY_MM_PROCESSORS = """
    from weft.contracts.mm_processor import MMProcessor, PlaceholderRange, ProcessedItem, ProcessedPrompt, item_hash

    class Padded(MMProcessor):
        '''The defect (an early DeepSeek V4.1 port's): each image span is padded to start at a multiple of 8, so
        the expansion depends on where the image sits.'''
        name = "padded"
        placeholder_token_id = 99
        align = 8

        def hash(self, item):
            return item_hash(item)

        def process(self, prompt_token_ids, items):
            if sum(token == 99 for token in prompt_token_ids) != len(items):
                raise ValueError("the placeholder count differs from the images")
            ids, processed, pending = [], [], iter(items)
            for token in prompt_token_ids:
                if token != 99:
                    ids.append(token)
                    continue
                item, start = next(pending), len(ids)
                ids += [98] * (-len(ids) % self.align) + [99] * (item.width // 8)
                processed.append(ProcessedItem(self.hash(item), (PlaceholderRange(start, len(ids) - start),), {}))
            return ProcessedPrompt(ids, processed)

    class SizeHash(Padded):
        '''The defect: no padding, but the hash covers the size only, so two images would share encoder outputs.'''
        name = "size-hash"
        align = 1

        def hash(self, item):
            return f"{item.width}x{item.height}"
"""


def test_mm_processor_kit_fails_position_dependent_padding_and_a_hash_blind_to_pixels(site, tmp_path):
    site.add_distribution(
        "weft-sloppy-mm",
        entry_points={"weft.mm_processor": {"padded": "sloppy_mm:Padded", "size-hash": "sloppy_mm:SizeHash"}},
        modules={"sloppy_mm": SLOPPY_MM_PROCESSORS},
    )
    result = run_kit(
        site,
        tmp_path,
        """
        from weft.testing import MMProcessorContract

        class TestPadded(MMProcessorContract):
            plugin_name = "padded"

        class TestSizeHash(MMProcessorContract):
            plugin_name = "size-hash"
        """,
    )
    summary = result.stdout.split("short test summary")[-1]
    assert "TestPadded::test_expansion_of_an_item_does_not_depend_on_its_offset" in summary, result.stdout
    assert "TestSizeHash::test_equal_images_hash_equal_and_different_ones_differ" in summary
    assert "2 failed" in result.stdout, result.stdout
