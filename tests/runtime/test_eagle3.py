"""The ``eagle3`` drafter on the tiny random Llama: the graph exposes exactly the hidden states Hugging Face
computes, the head is fed each position once with the right token (a prefix-cache hit's cached positions from the
store of hidden states), its cached steps equal one full forward, output is the output without speculation, and a
head that does not fit the model is refused at build."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import ConfigError
from autodeploy.runtime.eagle3 import Eagle3Config, Eagle3Head, eagle3_config, load_eagle3_head, save_eagle3_head
from autodeploy.runtime.hidden_state_heads import HeadSequence
from tests.runtime.test_engine import random_prompts
from tests.tiny_models import tiny_hf_model

LAYERS = [1, 1, 1]  # the tiny Llama has two layers: the residual stream between them, three times


def make_head(target_config, seed: int = 0, draft_vocab: int | None = None, layers=LAYERS) -> Eagle3Head:
    config = Eagle3Config.from_dict(eagle3_config(target_config, draft_vocab, layers))
    torch.manual_seed(seed)
    head = Eagle3Head(config, target_config.num_hidden_layers)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.2) if parameter.dim() > 1 else parameter.fill_(1.0)
        if draft_vocab:  # the draft vocabulary: every other token of the model's
            head.d2t.copy_(torch.arange(draft_vocab))
    return head


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    hf = tiny_hf_model("llama")
    return save_eagle3_head(make_head(hf.config, draft_vocab=256), tmp_path_factory.mktemp("eagle3-head"))


@pytest.fixture(scope="module")
def eagle_llm(llama_dir, head_dir):
    return autodeploy(str(llama_dir), device="cpu", verify={"enabled": False},
                      speculative={"method": "eagle3", "model": str(head_dir), "num_tokens": 3, "auto": False})


def check_what_the_head_is_fed(llm, expected_rows, seed: int = 0, prompt: list[int] | None = None,
                               first: int = 0) -> list[int]:
    """Generate one prompt (``prompt``, else a random one), recording what the head is fed from the model; each
    position from ``first`` on must come once, in order, with token ``p + 1`` and the rows ``expected_rows(sequence)``
    says the model computes there. The output's tokens."""
    drafter = llm.engine.speculator.drafter
    fed = []  # (positions, tokens, rows) of every catch-up step
    step = drafter.head.step

    def spy(hidden, tokens, positions, valid, slots, cache, from_model):
        if from_model:
            for b, count in enumerate(valid.sum(1).tolist()):
                fed.append((positions[b, :count].tolist(), tokens[b, :count].tolist(), hidden[b, :count].clone()))
        return step(hidden, tokens, positions, valid, slots, cache, from_model)

    drafter.head.step = spy
    try:
        prompt = prompt or random_prompts(1, seed=seed, lengths=(30, 30))[0]
        output = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    finally:
        del drafter.head.step
    sequence = prompt + output.token_ids
    with torch.no_grad():
        expected = expected_rows(sequence)
    positions = [p for ps, _, _ in fed for p in ps]
    assert positions == list(range(first, first + len(positions)))  # each position once, in order
    assert first + len(positions) >= len(prompt)
    for ps, tokens, rows in fed:
        assert tokens == [sequence[p + 1] for p in ps]
        torch.testing.assert_close(rows, expected[ps], atol=1e-4, rtol=1e-4)
    return output.token_ids


def entering_the_layers(sequence) -> torch.Tensor:
    """Hugging Face's hidden states entering the head's ``LAYERS`` at each position of ``sequence``, side by side."""
    states = tiny_hf_model("llama")(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    return torch.cat([states[layer][0] for layer in LAYERS], dim=-1)


def test_the_graph_exposes_the_hidden_states_hugging_face_computes_and_the_head_gets_each_position_once(eagle_llm):
    check_what_the_head_is_fed(eagle_llm, entering_the_layers, seed=5)


def test_greedy_output_is_the_output_without_speculation(eagle_llm, llama_llm):
    prompts = random_prompts(3, seed=11, lengths=(5, 50))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in eagle_llm.generate(prompts, params)] == \
        [o.token_ids for o in llama_llm.generate(prompts, params)]
    stats = eagle_llm.engine.speculator.stats
    assert stats.drafted > 0 and stats.steps > 0
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    assert eagle_llm.generate(prompts, seeded)[0].token_ids == llama_llm.generate(prompts, seeded)[0].token_ids


def test_tree_drafts_give_the_output_without_speculation_and_feed_the_head_each_kept_position(llama_dir, head_dir,
                                                                                              llama_llm):
    tree_llm = autodeploy(str(llama_dir), device="cpu", verify={"enabled": False},
                          speculative={"method": "eagle3", "model": str(head_dir), "num_tokens": 3, "tree_width": 3,
                                       "auto": False})
    prompts = random_prompts(3, seed=11, lengths=(5, 50))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in tree_llm.generate(prompts, params)] == \
        [o.token_ids for o in llama_llm.generate(prompts, params)]
    check_what_the_head_is_fed(tree_llm, entering_the_layers, seed=6)  # the kept nodes' rows, not the slots'


@pytest.mark.parametrize("tree_width", [1, 3])
def test_a_prefix_cache_hit_feeds_the_head_the_cached_positions_from_the_store(llama_dir, head_dir, llama_llm,
                                                                                tree_width):
    """A request whose prompt starts with an earlier one's never computes the cached positions: the head gets
    their rows from the store (the rows the earlier request computed), so it is fed every position, as without
    the hit."""
    llm = autodeploy(str(llama_dir), device="cpu", verify={"enabled": False},
                     speculative={"method": "eagle3", "model": str(head_dir), "num_tokens": 3, "tree_width": tree_width,
                                  "auto": False})
    drafter, pool = llm.engine.speculator.drafter, llm.engine.pool
    prompt = random_prompts(1, seed=21, lengths=(40, 40))[0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm.generate([prompt[:36]], params)  # computes positions 0 … 31 (two blocks), which the store keeps
    hits = pool.stats.hit_tokens
    output = check_what_the_head_is_fed(llm, entering_the_layers, prompt=prompt)  # every position, from 0
    assert pool.stats.hit_tokens - hits == 32 and drafter.store.recalled == 32
    assert output == llama_llm.generate([prompt], params)[0].token_ids
    assert "hidden states of" in drafter.describe()


def test_the_store_keeps_the_latest_blocks_within_its_budget_and_a_hit_on_an_evicted_one_feeds_fewer_positions(
        llama_dir, head_dir, llama_llm):
    block_bytes = 16 * len(LAYERS) * 64 * 4  # 16 positions of the tiny Llama's three hidden states, float32
    llm = autodeploy(str(llama_dir), device="cpu", verify={"enabled": False},
                     speculative={"method": "eagle3", "model": str(head_dir), "num_tokens": 3, "auto": False,
                                  "options": {"hidden_state_cache_mb": 4 * block_bytes / 2**20}})
    store = llm.engine.speculator.drafter.store
    assert store.capacity == 4
    first, other = random_prompts(2, seed=22, lengths=(40, 40))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm.generate([first], params)  # stores the first prompt's blocks 0, 1 and 2 (positions 0 … 47)
    llm.generate([other[:20]], params)  # writes two blocks of its own: the free one, and the first prompt's block 0
    output = check_what_the_head_is_fed(llm, entering_the_layers, prompt=first, first=16)
    assert store.recalled == 16  # block 1 of the hit's two, at positions 16 … 31
    assert output == llama_llm.generate([first], params)[0].token_ids
    assert store.num_registered <= store.capacity


def test_under_preemption_and_an_abort_the_store_holds_the_models_own_rows_under_each_key(llama_dir, head_dir,
                                                                                          llama_llm):
    """Prompts sharing prefixes in a pool small enough to preempt, one request aborted mid-way: output is the output
    without speculation, hits are fed from the store, and every block the store holds has the rows Hugging Face
    computes for the prefix its key names."""
    from autodeploy.runtime.block_pool import KVBlockPool

    llm = autodeploy(str(llama_dir), device="cpu", verify={"enabled": False}, kv_cache={"num_blocks": 12},
                     speculative={"method": "eagle3", "model": str(head_dir), "num_tokens": 3, "auto": False})
    bases = random_prompts(3, seed=23, lengths=(60, 60))
    tails = random_prompts(9, seed=24, lengths=(1, 9))
    prompts = [bases[i % 3][: 17 + 5 * i] + tail for i, tail in enumerate(tails)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    engine = llm.engine
    requests = [engine.add_request(prompt, params) for prompt in prompts[:4]]
    engine.step()
    aborted = engine.add_request(bases[0] + tails[0], params)
    engine.step()
    engine.step()
    engine.abort(aborted.request_id)
    requests += [engine.add_request(prompt, params) for prompt in prompts[4:]]
    while engine.has_unfinished():
        engine.step()
    outputs = [request.output(None).outputs[0].token_ids for request in requests]
    assert outputs == [o.token_ids for o in llama_llm.generate(prompts, params)]
    drafter = engine.speculator.drafter
    store = drafter.store
    assert engine.scheduler.num_preemptions > 0 and store.recalled > 0
    # Blocks being written belong to sequences the drafter still knows (it forgets finished ones at its next step).
    assert set(store._filling) <= set(drafter._sequences) and aborted.sequences[0].seq_id not in store._filling
    keys, checked = KVBlockPool(1, 16), 0
    for index, sequence in enumerate([prompt + output for prompt, output in zip(prompts, outputs)] + [bases[0]]):
        rows = entering_the_layers(sequence)
        for block_index, key in enumerate(keys.block_keys(index, sequence, len(sequence) // 16)):
            if key in store._registered:
                block = store._registered[key]
                torch.testing.assert_close(store.rows[block * 16 : (block + 1) * 16],
                                           rows[block_index * 16 : (block_index + 1) * 16], atol=1e-4, rtol=1e-4)
                checked += 1
    assert checked >= 6


def test_the_store_is_off_at_zero_megabytes_or_without_prefix_caching_and_a_bad_size_is_refused(llama_dir, head_dir):
    def drafter(options: dict, **settings):
        return autodeploy(str(llama_dir), device="cpu", verify={"enabled": False}, **settings,
                          speculative={"method": "eagle3", "model": str(head_dir), "auto": False,
                                       "options": options}).engine.speculator.drafter

    assert drafter({"hidden_state_cache_mb": 0}).store is None
    assert drafter({}, kv_cache={"prefix_caching": False}).store is None
    assert drafter({}).store.capacity == 512 * 2**20 // (16 * len(LAYERS) * 64 * 4)  # the default, 512 MiB
    with pytest.raises(ConfigError, match="hidden_state_cache_mb must be a number of MiB ≥ 0"):
        drafter({"hidden_state_cache_mb": "lots"})


def test_a_block_handed_back_and_taken_again_in_one_step_holds_the_last_writers_rows(monkeypatch):
    """Two sequences compute the same block in one step (the second's copy goes back: its key is held) and a third
    takes that block at once: the copy into the store writes each row once, the third's."""
    from types import SimpleNamespace

    from autodeploy.runtime import hidden_state_heads
    from autodeploy.runtime.block_pool import KVBlockPool
    from autodeploy.runtime.hidden_state_heads import HeadDrafter
    from autodeploy.runtime.hidden_state_store import HiddenStateStore
    from autodeploy.runtime.scheduler import ScheduledChunk

    hf = tiny_hf_model("llama")
    head = make_head(hf.config)
    drafter = HeadDrafter(head, name="test head", graphs=False,
                          store=HiddenStateStore(2, 16, head.model_width, torch.device("cpu"), torch.float32))
    pool = KVBlockPool(8, 16)
    drafter.use_prefix_cache(pool)
    same, other = list(range(16)), list(range(100, 116))
    sequences = [SimpleNamespace(seq_id=i, finish_reason=None, request=None, token_ids=tokens)
                 for i, tokens in enumerate((same, same, other))]
    hidden = torch.randn(48, head.model_width)
    copies, gather = [], hidden_state_heads.gather_rows

    def spy(out, destinations, *rest):
        copies.append(destinations)
        return gather(out, destinations, *rest)

    monkeypatch.setattr(hidden_state_heads, "gather_rows", spy)
    drafter.observe([ScheduledChunk(s, 0, 16) for s in sequences], [0, 16, 32], hidden)
    assert len(copies[0]) == len(set(copies[0].tolist())) == 32
    first_block, rows = drafter.store.recall(pool.block_keys(2, other, 1), limit=4)
    assert first_block == 0 and torch.equal(rows, hidden[32:])


def test_the_store_hands_back_final_rows_of_full_blocks_by_key_least_recently_used_out_first():
    from autodeploy.runtime.hidden_state_store import HiddenStateStore

    store = HiddenStateStore(capacity=3, block_size=4, width=1, device=torch.device("cpu"), dtype=torch.float32)
    keys = {seq: [bytes([seq, block]) for block in range(8)] for seq in (1, 2, 3)}

    def write(seq: int, start: int, count: int, values, final=None, known=100):
        runs = store.place(seq, start, count, final)
        for position, row, length in runs:
            store.rows[row : row + length, 0] = torch.tensor(values[position - start : position - start + length])
        if ready := store.ready(seq, known):
            store.register(seq, keys[seq][:ready])
        return runs[0][0] if runs else None

    write(1, 0, 6, [0, 1, 2, 3, 4, 5])
    write(1, 6, 1, [6], known=6)  # block 1 is full, but its last token is not on the host yet
    assert store.num_registered == 1
    write(1, 7, 4, [7, 8, 90, 100], final=8)  # a draft of three at 8 … 10, not verified
    assert store.num_registered == 2  # block 1 (4 … 7); block 2 waits for the draft's verdict
    write(1, 9, 1, [9])  # the next chunk starts at 9: 8 was kept, 9 … 10 were refused
    write(1, 10, 2, [10, 11])
    assert store.num_registered == 3
    first_block, rows = store.recall(keys[1][:3], limit=8)
    assert first_block == 0 and rows[:, 0].tolist() == list(range(12))
    assert store.recall(keys[1][:3], limit=1)[0] == 2  # at most ``limit`` blocks, the latest
    store.release(1)
    assert write(2, 0, 4, [0, 0, 0, 0]) == 0  # a full store: the least recently used block (1's block 0) goes
    assert store.recall(keys[1][:2], limit=8)[0] == 1  # a run that ends at block 1 starts after the evicted block 0
    assert store.recall(keys[1][:1], limit=8) is None
    assert write(3, 5, 4, [5, 6, 7, 8]) == 8  # positions 5 … 7 follow nothing written: only block 2 (8 …) is kept


def test_cached_steps_equal_one_full_forward_and_drafts_map_to_the_models_vocabulary(llama_dir):
    hf = tiny_hf_model("llama")
    head = make_head(hf.config, seed=1, draft_vocab=256)
    width = len(LAYERS) * hf.config.hidden_size
    torch.manual_seed(2)
    fused, tokens = torch.randn(11, width), torch.randint(0, 512, (11,))
    with torch.no_grad():
        expected = head.reference_logits(fused, tokens)
        cache = head.new_cache(slots=3, window=16, chain=4)
        slot = torch.tensor([cache.slot(seq_id=9)])
        pieces = []
        for start, stop in ((0, 4), (4, 5), (5, 11)):
            out = head.step(fused[None, start:stop], tokens[None, start:stop], torch.arange(start, stop)[None],
                            torch.ones(1, stop - start, dtype=torch.bool), slot, cache, from_model=True)
            pieces.append(head.logits(out[0]))
    torch.testing.assert_close(torch.cat(pieces), expected, atol=1e-5, rtol=1e-5)
    assert head.to_target(torch.tensor([0, 5, 255])).tolist() == [0, 10, 510]


def test_two_sequences_padded_into_one_step_equal_each_alone():
    hf = tiny_hf_model("llama")
    head = make_head(hf.config, seed=4)
    width = len(LAYERS) * hf.config.hidden_size
    torch.manual_seed(5)
    a, b = (torch.randn(n, width) for n in (6, 3))
    ta, tb = (torch.randint(0, 512, (n,)) for n in (6, 3))
    with torch.no_grad():
        alone = [head.reference_logits(a, ta), head.reference_logits(b, tb)]
        hidden = torch.zeros(2, 6, width)
        hidden[0], hidden[1, :3] = a, b
        tokens = torch.zeros(2, 6, dtype=torch.long)
        tokens[0], tokens[1, :3] = ta, tb
        positions = torch.tensor([list(range(6)), [0, 1, 2, 2, 2, 2]])  # padding rows repeat the last position
        valid = positions.new_tensor([[1] * 6, [1, 1, 1, 0, 0, 0]]).bool()
        cache = head.new_cache(slots=2, window=8, chain=1)
        out = head.logits(head.step(hidden, tokens, positions, valid, torch.tensor([1, 0]), cache, from_model=True))
    torch.testing.assert_close(out[0], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :3], alone[1], atol=1e-5, rtol=1e-5)


def test_a_head_that_does_not_fit_the_model_is_refused_at_build(llama_dir, head_dir, tmp_path):
    def variant(name, edit=None, drop=None):
        folder = tmp_path / name
        shutil.copytree(head_dir, folder)
        if edit:
            config = json.loads((folder / "config.json").read_text())
            edit(config)
            (folder / "config.json").write_text(json.dumps(config))
        if drop:
            from safetensors.torch import load_file, save_file

            state = load_file(str(folder / "model.safetensors"))
            state.pop(drop)
            save_file(state, str(folder / "model.safetensors"))
        return str(folder)

    cases = [
        (str(tmp_path / "nowhere"), "has no config.json"),
        (variant("vocab", lambda c: c.update(vocab_size=1000)), "has vocabulary 1000; this model's is 512"),
        (variant("layers", lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 5, 9]})),
         r"reads the hidden states entering layer\(s\) \[5, 9\]"),
        (variant("width", lambda c: c.update(target_hidden_size=32)), "trained for hidden size 32; this model's is 64"),
        (variant("no-fc", drop="fc.weight"), r"does not match its config.json: missing \['fc.weight'\]"),
        (variant("no-d2t", drop="d2t"), "no d2t map"),
    ]
    for model, message in cases:
        with pytest.raises(ConfigError, match=message):
            autodeploy(str(llama_dir), device="cpu", verify={"enabled": False},
                       speculative={"method": "eagle3", "model": model, "auto": False})
    with pytest.raises(ConfigError, match="speculative.model is not set"):
        autodeploy(str(llama_dir), device="cpu", speculative={"method": "eagle3"})


def test_a_loaded_head_uses_the_models_embedding_when_it_has_none(llama_dir, head_dir):
    hf = tiny_hf_model("llama")
    head = load_eagle3_head(head_dir, 2, 64, 512, hf.model.embed_tokens.weight, torch.device("cpu"), torch.float32)
    assert torch.equal(head.embed_tokens.weight, hf.model.embed_tokens.weight)


def test_a_saved_eagle3_deployment_reloads_and_drafts_and_a_plain_one_cannot_load_eagle3(
        eagle_llm, llama_llm, head_dir, tmp_path):
    reloaded = autodeploy(str(eagle_llm.save(tmp_path / "eagle")),
                          speculative={"method": "eagle3", "model": str(head_dir), "num_tokens": 3, "auto": False})
    prompts = random_prompts(3, seed=13, lengths=(5, 40))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in reloaded.generate(prompts, params)] == \
        [o.token_ids for o in eagle_llm.generate(prompts, params)] == [o.token_ids for o in llama_llm.generate(prompts, params)]
    assert reloaded.engine.speculator.stats.drafted > 0
    narrow = autodeploy(str(reloaded.deployment.model_directory or eagle_llm.deployment.model_directory), device="cpu",
                        verify={"enabled": False}, scheduler={"max_num_tokens": 128},
                        speculative={"method": "eagle3", "model": str(head_dir), "num_tokens": 3, "auto": False})
    with pytest.raises(ConfigError, match="copies out the hidden states of at most 128 tokens a step"):
        autodeploy(str(narrow.save(tmp_path / "narrow")), scheduler={"max_num_tokens": 256})
    directory = llama_llm.save(tmp_path / "plain")
    with pytest.raises(ConfigError, match="exposes no hidden states"):
        autodeploy(str(directory), speculative={"method": "eagle3", "model": str(head_dir)})


def test_held_rows_are_replaced_by_a_later_forward_and_capped_at_the_context():
    state = HeadSequence(sequence=None)
    tensors = {1: torch.arange(100, dtype=torch.float32)[:, None]}  # step 1's row p holds position p
    tensors[2] = tensors[1] + 0.5
    state.keep(0, 1, 0, 6, context=100)
    state.keep(4, 2, 4, 5, context=100)  # positions 4 … 8 computed again (a rejected draft's rows replaced)
    positions, held = state.take(7, tensors)
    assert positions == list(range(7)) and held[:, 0].tolist() == [0, 1, 2, 3, 4.5, 5.5, 6.5]
    assert state.held == 2 and state.next_position == 7
    state.keep(3, 1, 3, 2, context=100)  # positions the head already fed are dropped
    assert state.held == 2
    state.keep(8, 1, 8, 1, context=100)  # position 8 again: replaces the held one
    state.keep(9, 1, 9, 10, context=5)  # past the context: the latest positions stay
    positions, held = state.take(19, tensors)
    assert positions == list(range(14, 19)) and held[:, 0].tolist() == [14, 15, 16, 17, 18]
    state.keep(19, 1, 19, 3, context=100)
    state.keep(20, 2, 20, 1, context=100)  # a shorter recomputation: position 21 is not held any more
    positions, held = state.take(22, tensors)
    assert positions == [19, 20] and held[:, 0].tolist() == [19, 20.5]
    state.keep(30, 1, 30, 2, context=100)  # positions 21 … 29 never computed here (a prefix-cache hit): skipped
    assert state.take(32, tensors)[0] == [30, 31]


def test_a_verified_tree_leaves_the_kept_nodes_rows_at_the_positions_they_take():
    from types import SimpleNamespace

    from autodeploy.runtime.hidden_state_heads import HeadDrafter
    from autodeploy.runtime.scheduler import ScheduledChunk

    hf = tiny_hf_model("llama")
    drafter = HeadDrafter(make_head(hf.config), name="test head", tree_width=2)
    sequence = SimpleNamespace(seq_id=7, finish_reason=None, request=None)
    hidden = torch.arange(8, dtype=torch.float32)[:, None]  # row r holds r
    chunk = ScheduledChunk(sequence, 10, 6, draft=[1, 2, 3, 4, 5], draft_parents=[-1, -1, 0, 1, 3])
    drafter.observe([ScheduledChunk(SimpleNamespace(seq_id=8, finish_reason=None, request=None), 0, 2), chunk],
                    [0, 2], hidden)
    drafter.accepted(sequence, 10, [1, 3, 4])  # nodes 1, 3, 4 (rows 2 + 2, 2 + 4, 2 + 5) now hold positions 11, 12, 13
    positions, rows = drafter._sequences[7].take(14, drafter._tensors)
    assert positions == [10, 11, 12, 13] and rows[:, 0].tolist() == [2, 4, 6, 7]


def test_past_its_window_the_head_attends_over_the_latest_positions_only():
    hf = tiny_hf_model("llama")
    head = make_head(hf.config, seed=6)
    width = len(LAYERS) * hf.config.hidden_size
    torch.manual_seed(7)
    fused, tokens = torch.randn(30, width), torch.randint(0, 512, (30,))
    with torch.no_grad():
        cache = head.new_cache(slots=2, window=8, chain=2)
        slot = torch.tensor([cache.slot(seq_id=1)])
        for start, stop in ((0, 7), (7, 10), (10, 11), (11, 16), (16, 20), (20, 30)):  # the ring wraps, feeds overrun it
            out = head.step(fused[None, start:stop], tokens[None, start:stop], torch.arange(start, stop)[None],
                            torch.ones(1, stop - start, dtype=torch.bool), slot, cache, from_model=True)
        fresh = head.new_cache(slots=1, window=8, chain=2)  # the last 8 positions alone give the last row's output
        alone = head.step(fused[None, 22:], tokens[None, 22:], torch.arange(22, 30)[None],
                          torch.ones(1, 8, dtype=torch.bool), torch.tensor([0]), fresh, from_model=True)
    torch.testing.assert_close(out[0, -1], alone[0, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tree_width", [1, 2])
def test_on_the_gpu_drafting_replays_captured_graphs_and_changes_no_token(llama_dir, head_dir, gpu_llama_llm, tree_width):
    llm = autodeploy(str(llama_dir), device="cuda", dtype="float32", kv_cache={"num_blocks": 64}, verify={"enabled": False},
                     speculative={"method": "eagle3", "model": str(head_dir), "num_tokens": 3, "tree_width": tree_width,
                                  "auto": False})
    drafter = llm.engine.speculator.drafter
    assert drafter.graphs is not None and drafter.graphs.sizes[0] == 1
    assert drafter.cache.kernel is not None, drafter.attention  # the slot-attention kernel, checked at build
    replays = []
    draft = drafter.graphs.draft
    drafter.graphs.draft = lambda feeds, sequences: (replays.append(len(feeds)), draft(feeds, sequences))[1]
    prompts = random_prompts(6, seed=11, lengths=(5, 50))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in gpu_llama_llm.generate(prompts, params)]
    assert replays and llm.engine.speculator.stats.drafted > 0


def test_the_padded_static_inputs_a_cuda_graph_replays_draft_what_the_eager_step_drafts(llama_dir, head_dir, llama_llm):
    from autodeploy.runtime.hidden_state_heads import HeadGraphs

    def build(static: bool):
        llm = autodeploy(str(llama_dir), device="cpu", verify={"enabled": False}, max_batch_size=6,
                         speculative={"method": "eagle3", "model": str(head_dir), "num_tokens": 3, "tree_width": 2,
                                      "auto": False})
        drafter = llm.engine.speculator.drafter
        drafter.graphs = HeadGraphs(drafter, slots=6, capture=False) if static else None
        return llm

    prompts = random_prompts(5, seed=12, lengths=(5, 40))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    runs = []
    for static in (False, True):
        llm = build(static)
        drafts = []
        drafter = llm.engine.speculator.drafter
        call = drafter.__class__.__call__
        llm.engine.speculator.drafter = lambda sequences, limits: (lambda out: (drafts.append(out), out)[1])(
            call(drafter, sequences, limits))
        llm.engine.speculator.drafter.observe = drafter.observe
        llm.engine.speculator.drafter.accepted = drafter.accepted
        runs.append(([o.token_ids for o in llm.generate(prompts, params)], drafts))
    assert runs[0][0] == runs[1][0] == [o.token_ids for o in llama_llm.generate(prompts, params)]
    assert runs[0][1] == runs[1][1] and any(runs[0][1])


def test_with_auto_a_decode_step_that_drafts_nothing_hands_the_drafter_nothing(llama_dir, head_dir, llama_llm):
    from autodeploy.runtime.speculation_costs import StepCosts

    llm = autodeploy(str(llama_dir), device="cpu", verify={"enabled": False},
                     speculative={"method": "eagle3", "model": str(head_dir), "num_tokens": 3, "auto": False})
    speculator = llm.engine.speculator
    speculator.costs = StepCosts((1, 64), (1.0, 64.0), (100.0, 6400.0), 3)  # verifying never pays
    observed = []
    observe = speculator.drafter.observe
    speculator.drafter.observe = lambda chunks, rows, hidden: (observed.append([c.length for c in chunks]),
                                                                observe(chunks, rows, hidden))
    prompts = random_prompts(2, seed=4, lengths=(20, 30))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in llama_llm.generate(prompts, params)]
    assert observed and all(max(lengths) > 1 for lengths in observed)  # the prompts' steps only
    assert speculator.stats.drafted == 0


def test_tabulated_rotary_angles_are_the_computed_ones():
    hf = tiny_hf_model("llama")
    head = make_head(hf.config, seed=8)
    positions = torch.tensor([[0, 5, 17], [3, 39, 39]])
    x = torch.zeros(1)
    computed = head.angles(x, positions)
    head.tabulate_rotary(40)
    for got, want in zip(head.angles(x, positions), computed):
        torch.testing.assert_close(got, want)
    assert torch.equal(head.angles(x, torch.tensor([[45]]))[0], head.angles(x, torch.tensor([[39]]))[0])  # past: the last


def fused_and_plain_outputs(head, device: str, dtype: torch.dtype, rounds: int = 3):
    """The plain head's and its ``fuse``d copy's outputs over a feed of 9 positions, then ``rounds`` chain steps."""
    import copy

    plain = copy.deepcopy(head).to(device=device, dtype=dtype).eval()
    fused = head.placed(torch.device(device), dtype)
    plain.tabulate_rotary(64), fused.tabulate_rotary(64)
    torch.manual_seed(3)
    hidden = torch.randn(2, 9, head.model_width, device=device, dtype=dtype)
    tokens, chain = torch.randint(0, 512, (2, 9), device=device), torch.randint(0, 512, (2, rounds), device=device)
    positions = torch.arange(9, device=device).repeat(2, 1) + torch.tensor([[0], [20]], device=device)
    valid = torch.ones(2, 9, dtype=torch.bool, device=device)
    valid[1, 6:] = False  # the second sequence feeds 6 positions (padding repeats its last)
    positions[1, 6:] = positions[1, 5]
    slots = torch.tensor([0, 1], device=device)
    outputs = []
    with torch.inference_mode():
        for model in (plain, fused):
            cache = model.new_cache(2, 16, rounds)
            out = model.step(hidden, tokens, positions, valid, slots, cache, from_model=True)
            steps = [out[0, :9], out[1, :6]]
            last = torch.stack([out[0, 8], out[1, 5]])[:, None]
            for round_ in range(rounds):  # drafted tokens given (argmax could differ at a near-tie in bfloat16)
                last = model.step(last, chain[:, round_ : round_ + 1], positions[:, 8:9] + 1 + round_,
                                  valid[:, :1] | True, slots, cache, from_model=False)
                steps.append(last[:, 0])
            outputs.append([model.logits(s).float() for s in steps])
    return outputs


def test_the_fused_head_computes_what_the_plain_modules_do():
    """``placed`` runs the head through canonical ops (one GEMM for q/k/v, one rotary kernel, fused norms and MLP);
    on the CPU their torch backends, which must give the plain modules' logits."""
    hf = tiny_hf_model("llama")
    head = make_head(hf.config, seed=9)
    plain, fused = fused_and_plain_outputs(head, "cpu", torch.float32)
    for got, want in zip(fused, plain):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    layer = head.midlayer
    assert layer.input_layernorm.kernel == torch.ops.autodeploy.rms_norm_torch.default
    assert layer.self_attn.rope == torch.ops.autodeploy.rope_torch.default
    assert layer.mlp.gated == torch.ops.autodeploy.fused_gated_mlp_torch.default
    assert layer.self_attn.q_proj.weight.data_ptr() == layer.self_attn.qkv_weight.data_ptr()  # views: stored once
    mapped = make_head(hf.config, seed=9, draft_vocab=256).placed(torch.device("cpu"), torch.float32)
    ids = torch.tensor([[0, 5, 255]])
    assert torch.equal(mapped.to_target(ids), ids + mapped.d2t[ids]) and mapped.to_target(ids).tolist() == [[0, 10, 510]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_fused_head_runs_the_triton_kernels_and_drafts_what_the_plain_modules_do():
    hf = tiny_hf_model("llama")
    head = make_head(hf.config, seed=9)
    plain, fused = fused_and_plain_outputs(head, "cuda", torch.bfloat16)
    for got, want in zip(fused, plain):
        torch.testing.assert_close(got, want, atol=0.25, rtol=0.05)  # bf16: rounded at other places (measured ≤ 0.14)
    layer = head.midlayer
    assert layer.input_layernorm.kernel == torch.ops.autodeploy.rms_norm_triton.default
    assert layer.self_attn.rope == torch.ops.autodeploy.rope_triton.default
    assert layer.mlp.gated == torch.ops.autodeploy.fused_gated_mlp_triton.default


def test_drafts_stay_on_the_device_until_the_steps_samples_come_back(eagle_llm, llama_llm, monkeypatch):
    """The head's drafts go into the verification step from the device (the host reads them with the samples); a
    sequence with a penalty (its sampling reads the draft) gets them on the host first. Output is the same."""
    drafter, speculator = eagle_llm.engine.speculator.drafter, eagle_llm.engine.speculator
    calls, on_device = [], drafter.on_device
    monkeypatch.setattr(drafter, "on_device", lambda sequences, limits: (calls.append(len(sequences)), on_device(sequences, limits))[1])
    prompts = random_prompts(3, seed=13, lengths=(5, 30))
    for params, device in ((SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), True),
                           (SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3), False)):
        calls.clear()
        drafted = speculator.stats.drafted
        assert [o.token_ids for o in eagle_llm.generate(prompts, params)] == [o.token_ids for o in llama_llm.generate(prompts, params)]
        assert speculator.stats.drafted > drafted and bool(calls) == device
        assert speculator._drafted is None  # read back with the last step's samples
