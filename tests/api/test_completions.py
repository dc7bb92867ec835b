"""`/v1/completions` and `GET /v1/models/{id}` on a real uvicorn server with the tiny model, driven by the official
`openai` client: prompts as strings, lists and token ids; streaming equal to the whole answer; echo and the legacy
logprobs; stop; n with a seed equal to one-by-one requests with derived seeds; min_tokens; suffix refused."""

from __future__ import annotations

import httpx
import openai
import pytest

from api.background import BackgroundServer
from api.server import create_app
from api.settings import Limits, ServerSettings
from engine import EngineConfig
from engine.presets import preset_checkpoint

MODEL = "vlmcap-tiny"
PROMPT = "User: What is in a street scene?<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(engine=EngineConfig(model="tiny", max_num_batched_tokens=256),
                              served_model_name=MODEL, limits=Limits(max_tokens_cap=4096))
    with BackgroundServer(create_app(settings)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def greedy(client, prompt, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, **{"max_tokens": 12, "temperature": 0, **kwargs})


def test_a_string_prompt_gives_text_and_usage(client, server):
    answer = greedy(client, PROMPT)
    assert answer.object == "text_completion" and len(answer.choices) == 1
    choice = answer.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    tokenizer = server.state.bridge.engine.tokenizer
    assert answer.usage.completion_tokens >= len(tokenizer(choice.text, add_special_tokens=False).input_ids) - 1
    assert answer.usage.prompt_tokens > 0
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_lists_of_prompts_and_token_ids_give_one_choice_each_in_order(client, server):
    other = "User: Describe the people.<end_of_utterance>\nAssistant:"
    one, two = greedy(client, PROMPT).choices[0].text, greedy(client, other).choices[0].text
    both = greedy(client, [PROMPT, other])
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [one, two]
    ids = server.state.bridge.engine.tokenizer(PROMPT, add_special_tokens=False).input_ids
    assert greedy(client, ids).choices[0].text == one
    assert [c.text for c in greedy(client, [ids, ids]).choices] == [one, one]


def test_streamed_text_equals_the_whole_answer_and_ends_with_usage(client):
    whole = greedy(client, PROMPT).choices[0].text
    chunks = list(greedy(client, PROMPT, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_echo_and_logprobs_in_the_legacy_format(client, server):
    whole = greedy(client, PROMPT).choices[0].text
    choice = greedy(client, PROMPT, echo=True, logprobs=3).choices[0]
    assert choice.text == PROMPT + whole
    lp = choice.logprobs
    prompt_ids = server.state.bridge.engine.adapter.process(PROMPT, [], [], None)[0]
    n = len(prompt_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    scored = lp.token_logprobs[1:n]
    assert all(v <= 0 for v in scored) and all(len(top) <= 3 for top in lp.top_logprobs[1:n])
    assert all(max(top.values()) >= value - 1e-5 for top, value in zip(lp.top_logprobs[1:n], scored, strict=True))
    generated = lp.token_logprobs[n:]
    assert generated and all(v <= 0 for v in generated)
    assert all(len(top) <= 3 and max(top.values()) >= value - 1e-5  # the chosen token is the likeliest (greedy)
               for top, value in zip(lp.top_logprobs[n:], generated, strict=True))
    tokenizer = server.state.bridge.engine.tokenizer
    assert "".join(lp.tokens[n:]) == tokenizer.decode(tokenizer(whole, add_special_tokens=False).input_ids) \
        or whole in "".join(lp.tokens[n:])  # special tokens are in `tokens`, not in the text
    assert lp.text_offset == sorted(lp.text_offset) and len(lp.text_offset) == len(lp.tokens)


def test_echoed_prompt_logprobs_equal_vllms_prompt_logprobs_streamed_or_not(client, server):
    """lm-eval's loglikelihood call: token ids, echo, logprobs 1, one new token; the prompt's scores equal those of
    vLLM's `prompt_logprobs` field, and a streamed answer's first chunk carries them too."""
    ids = server.state.bridge.engine.tokenizer(PROMPT, add_special_tokens=False).input_ids
    echoed = greedy(client, ids, echo=True, logprobs=1, max_tokens=1).choices[0].logprobs
    extension = greedy(client, ids, max_tokens=1, extra_body={"prompt_logprobs": 0}).choices[0]
    scores = extension.model_extra["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    assert [s[str(t)]["logprob"] for s, t in zip(scores[1:], ids[1:], strict=True)] == pytest.approx(
        echoed.token_logprobs[1:len(ids)], abs=1e-5)
    assert all(s[str(t)]["rank"] >= 1 for s, t in zip(scores[1:], ids[1:], strict=True))
    chunks = list(greedy(client, ids, echo=True, logprobs=1, max_tokens=1, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[:len(ids)] == pytest.approx(echoed.token_logprobs[:len(ids)], abs=1e-5)


def test_prompt_logprobs_are_refused_when_streamed_or_out_of_range(client):
    for extra, stream in (({"prompt_logprobs": 1}, True), ({"prompt_logprobs": 21}, False)):
        with pytest.raises(openai.BadRequestError) as raised:
            greedy(client, PROMPT, stream=stream, extra_body=extra)
        assert raised.value.body["param"] == "prompt_logprobs"


def test_stop_ends_the_text_before_the_stop_string(client):
    whole = greedy(client, PROMPT, max_tokens=24).choices[0].text
    stop = whole[len(whole) // 2: len(whole) // 2 + 2]
    assert stop.strip()
    choice = greedy(client, PROMPT, max_tokens=24, stop=[stop]).choices[0]
    assert choice.finish_reason == "stop" and choice.text == whole[: whole.index(stop)]


def test_n_choices_with_a_seed_equal_one_by_one_requests_with_derived_seeds(client):
    def sampled(**kwargs):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, **kwargs)

    together = sampled(n=3, seed=7)
    assert [c.index for c in together.choices] == [0, 1, 2]
    alone = [sampled(seed=7 + i).choices[0].text for i in range(3)]
    assert [c.text for c in together.choices] == alone
    assert len(set(alone)) > 1  # derived seeds, not one seed three times
    streamed: dict[int, str] = {}
    for chunk in sampled(n=3, seed=7, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == alone


def test_min_tokens_and_stop_token_ids_over_http(client, server):
    ids = server.state.bridge.engine.tokenizer(greedy(client, PROMPT).choices[0].text,
                                                  add_special_tokens=False).input_ids
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"min_tokens": 8, "stop_token_ids": [ids[0]]})
    assert held.usage.completion_tokens == 8
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": [ids[0]]})
    assert stopped.usage.completion_tokens < 8 and stopped.choices[0].finish_reason == "stop"


def test_bad_requests_are_400_in_openais_body(server):
    def post(**body):
        return httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body}, timeout=30)

    cases = [({"suffix": "the end"}, "suffix"), ({"min_tokens": 9, "max_tokens": 4}, None),
             ({"prompt": [10**9]}, "prompt[0]"), ({"best_of": 3}, "best_of"),
             ({"stream_options": {}}, "stream_options")]
    for body, param in cases:
        response = post(**body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        if param:
            assert error["param"] == param
    assert "min_tokens" in post(min_tokens=9, max_tokens=4).json()["error"]["message"]
    assert post(model="nope").status_code == 404


def test_models_retrieve_and_an_unknown_id(client, server):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found"
    response = httpx.get(f"{server.url}/v1/models/no-such-model", timeout=30)
    assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_chat_takes_min_tokens_and_stop_token_ids(client, server):
    messages = [{"role": "user", "content": "Hello"}]
    text = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    first = server.state.bridge.engine.tokenizer(text.choices[0].message.content, add_special_tokens=False).input_ids
    stopped = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                             extra_body={"stop_token_ids": [first[0]]})
    assert stopped.usage.completion_tokens < 8 and stopped.choices[0].finish_reason == "stop"
    held = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"stop_token_ids": [first[0]], "min_tokens": 8})
    assert held.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={"min_tokens": 3})


def test_token_id_prompts_run_as_given_equal_to_generate_on_those_ids(client, server):
    """Ids the tokenizer would never produce from their text (a word as single characters) run as they are."""
    import torch
    from transformers import AutoModelForImageTextToText

    engine = server.state.bridge.engine
    tokenizer = engine.tokenizer
    ids = tokenizer(PROMPT, add_special_tokens=False).input_ids
    spelled = [tokenizer.convert_tokens_to_ids(c) for c in "street"]
    assert tokenizer.unk_token_id not in spelled
    ids = ids[:3] + spelled + ids[3:]
    assert tokenizer(tokenizer.decode(ids), add_special_tokens=False).input_ids != ids  # text would not round-trip
    answer = greedy(client, ids, max_tokens=8)
    assert answer.usage.prompt_tokens == len(ids)
    model = AutoModelForImageTextToText.from_pretrained(preset_checkpoint("tiny"), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    expected = tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    assert answer.choices[0].text == expected
    image_token = engine.adapter.model.config.image_token_id
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": ids + [image_token]},
                          timeout=30)
    assert response.status_code == 400 and "placeholder" in response.json()["error"]["message"]


def test_lm_evals_requests_as_it_sends_them(server):
    """lm-eval's `--model local-completions` (0.4.13, tokenizer_backend huggingface, batch_size 3), its two request
    shapes as it sends them. Loglikelihood: token-id prompts batched, echo, logprobs 1, max_tokens 1; lm-eval sums
    `token_logprobs[ctxlen:-1]` (equal to transformers' own forward here) and calls a continuation greedy when each
    token's log-probability equals the largest of its `top_logprobs` (exactly, as floats). Generation: token-id
    prompts batched, stop strings with the EOS token's text, seed; each choice the greedy text cut at a stop."""
    import torch
    from transformers import AutoModelForImageTextToText

    tokenizer = server.state.bridge.engine.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(preset_checkpoint("tiny"), dtype=torch.float32).eval()

    def scores(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)

    context = tokenizer("Question: Who waits at the bus stop?\nAnswer:", add_special_tokens=False).input_ids
    greedy_ids = list(context)
    for _ in range(3):  # a continuation the model itself would choose: lm-eval's is_greedy is True for it
        greedy_ids.append(int(scores(greedy_ids)[-1].argmax()))
    prompts = [tokenizer("Question: Who waits at the bus stop?\nAnswer:" + text, add_special_tokens=False).input_ids
               for text in (" a man", " nobody")] + [greedy_ids]
    assert all(ids[:len(context)] == context for ids in prompts)
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts)
    greedy_flags = []
    for choice, ids in zip(choices, prompts, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt's, then the one new token's
        reference = scores(ids)
        expected = [reference[i - 1, ids[i]].item() for i in range(len(context), len(ids))]
        assert lp["token_logprobs"][len(context):-1] == pytest.approx(expected, abs=1e-4)
        flags = [value == max(top.values()) for value, top in zip(lp["token_logprobs"][len(context):-1],
                                                                  lp["top_logprobs"][len(context):-1], strict=True)]
        assert flags == [int(reference[i - 1].argmax()) == ids[i] for i in range(len(context), len(ids))]
        greedy_flags.append(all(flags))
    assert greedy_flags[-1]
    eos = tokenizer.decode([tokenizer.eos_token_id])
    body = {"model": MODEL, "prompt": prompts[:2], "max_tokens": 16, "temperature": 0, "stop": ["\n", "Question:", eos],
            "seed": 1234}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    for choice, ids in zip(sorted(answer["choices"], key=lambda c: c["index"]), prompts[:2], strict=True):
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        text = tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
        cut = min([text.index(s) for s in body["stop"] if s in text], default=len(text))
        assert choice["text"] == text[:cut]


SOAK_CASES = ["prompt_logprobs_over_cap", "prompt_logprobs_streamed", "store_metadata_huge", "stored_list_over_limit",
              "stored_list_after_unknown", "stored_unknown_id", "stored_update_bad_body"]


def test_the_soaks_prompt_logprobs_and_store_cases_here(server):
    """`vlmcap bench soak`'s cases of prompt log-probabilities and stored completions against this server: the
    hostile ones each a 4xx, the good ones (lm-eval's scored prompt, a stored chat read back and deleted) 200."""
    import asyncio
    import random

    from bench.configs import SoakConfig
    from bench.soak import HOSTILE_REQUESTS, Client, Tally

    async def send() -> list:
        tally = Tally()
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            client = Client(http, SoakConfig(max_tokens=4), [], MODEL)
            for name in SOAK_CASES:
                await client._record(tally, f"hostile:{name}", HOSTILE_REQUESTS[name](client))
            for seed in range(2):  # both prompt_logprobs and plain, streamed and not
                await client.scored_prompt(tally, random.Random(seed))
                await client.stored_chat(tally, random.Random(seed))
        return tally.outcomes

    outcomes = asyncio.run(send())
    hostile = {o.kind.removeprefix("hostile:"): o.status for o in outcomes if o.kind.startswith("hostile:")}
    assert set(hostile) == set(SOAK_CASES)
    assert all(status is not None and 400 <= status < 500 for status in hostile.values()), hostile
    good = [(o.kind, o.status, o.error) for o in outcomes if not o.kind.startswith("hostile:")]
    assert len(good) == 4 and all(status == 200 for _, status, _ in good), good
