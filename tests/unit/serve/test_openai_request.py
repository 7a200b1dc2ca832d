"""The OpenAI completions request (graphmode.serve.openai_request) and what a choice shows of
its tokens (graphmode.decode.output.ChoiceOutput), without a server: field by field
refusals that name the field, the value and the fix; the sampling parameters a request
means; stop sequences and stop strings held back while streaming and cut from the answer."""
from __future__ import annotations

import json

import pytest

from graphmode.decode.output import ChoiceOutput
from graphmode.serve.chat import render
from graphmode.serve.errors import BadRequest
from graphmode.serve.openai_request import GREEDY_BELOW, choice_seed, parse_chat, parse_completion

EOS = 2


@pytest.fixture(scope="module")
def tok():
    """Words w3 ... w99 split on whitespace (the tokenizer of tests/e2e/tiny_decoders.py)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, 100)]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def parse(doc, tokenizer=None):
    return parse_completion(json.dumps(doc).encode(), tokenizer=tokenizer, eos=EOS)


def test_sampling_parameters_a_request_means(tok):
    r = parse({"prompt": [5, 6]})
    assert r.prompts == [[5, 6]] and r.params.max_new_tokens == 16 and r.params.do_sample   # OpenAI's defaults
    assert r.params.eos == {EOS} and not r.stream and r.model is None
    for t in (0, 0.0, GREEDY_BELOW / 10, 1e-300):            # greedy (1e-300 would divide logits into inf)
        assert not parse({"prompt": [5], "temperature": t}).params.do_sample, t
    p = parse({"prompt": [5], "temperature": 0.7, "top_k": -1, "top_p": 1, "seed": -3, "ignore_eos": True}).params
    assert (p.do_sample, p.temperature, p.top_k, p.top_p, p.seed, p.eos) == (True, 0.7, None, None, -3, frozenset())
    p = parse({"prompt": [5], "top_k": 5, "top_p": 0.5, "stop": [[7, 8]], "stop_token_ids": [9]}).params
    assert (p.top_k, p.top_p, p.stop) == (5, 0.5, ((7, 8), (9,)))
    r = parse({"prompt": ["w5 w6", "w7"], "stop": ["w9", " w10"], "stream": True,
               "stream_options": {"include_usage": True}}, tok)
    assert r.prompts == [[5, 6], [7]] and r.stop_text == ("w9", " w10") and r.stream and r.include_usage
    neutral = {"n": 1, "best_of": 1, "echo": False, "presence_penalty": 0.0, "frequency_penalty": 0,
               "logit_bias": {}, "logprobs": None, "user": "u", "model": "m", "response_format": {"type": "text"}}
    assert parse({"prompt": [[5], [6]], **neutral}).prompts == [[5], [6]]
    r = parse({"prompt": [[5], [6]], "n": 2, "best_of": 2, "seed": 4, "logprobs": 3, "presence_penalty": -1,
               "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_tokens": 2, "max_tokens": 5})
    p = r.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens, p.logprobs) == (
        -1, 0.5, 1.2, 2, 3)
    # choice i * n + j is prompt i's j-th sample; choice 0 seeded as asked, the others by a hash of (seed, j)
    # (seed + j gave request seed 5's answer as request seed 4's second choice)
    assert [(q, s.seed) for q, s in r.sequences] == [([5], 4), ([5], choice_seed(4, 1)), ([6], 4),
                                                     ([6], choice_seed(4, 1))]
    assert len({4, 5, choice_seed(4, 1), choice_seed(5, 1)}) == 4 and 0 <= choice_seed(2**63 - 1, 15) < 2**63
    assert parse({"prompt": [5], "echo": True}).echo
    scored = parse({"prompt": [5, 6], "echo": True, "logprobs": 0, "max_tokens": 0})      # score the prompt only
    assert scored.prompt_only and scored.echo and scored.params.logprobs == 0
    assert not parse({"prompt": [5], "echo": True, "logprobs": 2}).prompt_only
    assert parse({"prompt": [5], "logit_bias": {"7": -100, "9": 2.5}}).params.logit_bias == ((7, -100.0), (9, 2.5))


def chat(doc, tokenizer=None, context=48):
    return parse_chat(json.dumps(doc).encode(), tokenizer=tokenizer, eos=EOS, context=context,
                      render=lambda m, *options: render(tokenizer, m, *options))


MSG = [{"role": "user", "content": "w5 w6"}]


def test_chat_requests(tok):
    r = chat({"messages": MSG, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2}, tok)
    assert r.chat and r.params.max_new_tokens == 4 and r.params.logprobs == 2
    assert tok.decode(r.prompts[0]) == "<unk> w5 w6 <unk>"          # "user: w5 w6\nassistant:"
    r = chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "w5"}, {"type": "text",
                                                                                       "text": "w6"}]}]}, tok)
    assert tok.decode(r.prompts[0]) == "<unk> w5 w6 <unk>" and r.params.max_new_tokens == 48 - 4   # the pages' rest
    assert chat({"messages": MSG, "logprobs": True}, tok).params.logprobs == 0
    assert chat({"messages": MSG, "tools": [], "tool_choice": "none", "max_tokens": 3,
                 "max_completion_tokens": 3}, tok).params.max_new_tokens == 3


@pytest.mark.parametrize("doc,where", [
    ({"messages": MSG}, "messages"),                                           # no tokenizer
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"), ({"messages": [3]}, "messages[0]"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": MSG, "max_tokens": 2, "max_completion_tokens": 3}, "max_completion_tokens"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"), ({"messages": MSG, "logprobs": 2}, "logprobs"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, "tools"), ({"messages": MSG, "prompt": [5]}, "body"),
    ({"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format"),
])
def test_every_chat_refusal_names_the_field_and_the_fix(tok, doc, where):
    with pytest.raises(BadRequest) as e:
        chat(doc, None if where == "messages" and doc == {"messages": MSG} else tok)
    assert e.value.status == 400 and e.value.where == where and e.value.fix, e.value.to_dict()


@pytest.mark.parametrize("doc,where", [
    ({"prompt": "text"}, "prompt"),                               # no tokenizer: ids only
    ({"prompt": [5], "stop": "w5"}, "stop"),
    ({"prompt": 5}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [[5], []]}, "prompt[1]"),
    ({"prompt": [[5]] * 65}, "prompt"), ({"prompt": [5, 1.0]}, "prompt"), ({}, "prompt"),
    ({"prompt": [5], "max_tokens": True}, "max_tokens"), ({"prompt": [5], "max_tokens": 2**31}, "max_tokens"),
    ({"prompt": [5], "temperature": -0.1}, "temperature"), ({"prompt": [5], "top_p": 1.5}, "top_p"),
    ({"prompt": [5], "top_k": -2}, "top_k"), ({"prompt": [5], "seed": "1"}, "seed"),
    ({"prompt": [5], "stream": 1}, "stream"), ({"prompt": [5], "ignore_eos": "no"}, "ignore_eos"),
    ({"prompt": [5], "stop": [1, 2]}, "stop"), ({"prompt": [5], "stop": [[1], "a"]}, "stop"),
    ({"prompt": [5], "stop": [[1]] * 17}, "stop"), ({"prompt": [5], "stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"prompt": [5], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [5], "stream": True, "stream_options": {"x": 1}}, "stream_options"),
    ({"prompt": [5], "n": 0}, "n"), ({"prompt": [5], "n": 17}, "n"), ({"prompt": [[5]] * 8, "n": 9}, "n"),
    ({"prompt": [5], "best_of": 2}, "best_of"), ({"prompt": [5], "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": [5], "echo": 1}, "echo"), ({"prompt": [5], "logprobs": 21}, "logprobs"),
    ({"prompt": [5], "logprobs": True}, "logprobs"), ({"prompt": [5], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [5], "presence_penalty": 2.5}, "presence_penalty"), ({"prompt": [5], "frequency_penalty": "1"},
                                                                     "frequency_penalty"),
    ({"prompt": [5], "repetition_penalty": 0}, "repetition_penalty"), ({"prompt": [5], "min_tokens": -1}, "min_tokens"),
    ({"prompt": [5], "max_tokens": 3, "min_tokens": 4}, "min_tokens"), ({"prompt": [5], "suffix": "x"}, "suffix"),
    ({"prompt": [5], "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": [5], "logit_bias": {"x": 1}}, "logit_bias"), ({"prompt": [5], "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": [5], "logit_bias": {"\u00b2": 1}}, "logit_bias"), ({"prompt": [5], "logit_bias": [5]}, "logit_bias"), ({"prompt": [5], "max_completion_tokens": 3}, "body"),
    ({"prompt": [5], "model": 3}, "model"), ({"prompt": [5], "user": 3}, "user"),
    ({"prompt": [5], "max_token": 3}, "body"), ([5], "body"),
])
def test_every_refusal_names_the_field_and_the_fix(doc, where):
    with pytest.raises(BadRequest) as e:
        parse(doc)
    assert e.value.status == 400 and e.value.where == where and e.value.fix, e.value.to_dict()


def test_a_refused_value_is_shown_as_the_client_sent_it_in_json():
    for doc, shown in (({"prompt": [5], "max_tokens": True}, "true"),
                       ({"prompt": [5], "response_format": {"type": "json_object"}}, '{"type": "json_object"}'),
                       ({"prompt": [5], "frequency_penalty": "1"}, '"1"'), ({"prompt": [5], "n": 0}, "0")):
        with pytest.raises(BadRequest) as e:
            parse(doc)
        assert e.value.to_dict()["value"] == shown, e.value.to_dict()


def test_malformed_json_is_a_400_naming_the_body():
    for body in (b"", b"{", b'{"prompt": NaN}', b"\xff"):
        with pytest.raises(BadRequest) as e:
            parse_completion(body, tokenizer=None, eos=EOS)
        assert e.value.status == 400 and e.value.where == "body", body


def test_a_lone_surrogate_in_text_is_a_400_not_a_tokenizer_error(tok):
    """The tokenizer raised a TypeError on it: HTTP 500. A surrogate pair is text and stays."""
    with pytest.raises(BadRequest, match="lone UTF-16 surrogate") as e:
        parse_completion(b'{"prompt": "w5 \\ud800 w6", "max_tokens": 2}', tokenizer=tok, eos=EOS)
    assert e.value.status == 400 and e.value.where == "body"
    assert parse_completion(b'{"prompt": "w5 \\ud83d\\ude00", "max_tokens": 2}', tokenizer=tok, eos=EOS)


def test_text_the_tokenizer_cannot_encode_is_a_400_naming_the_tokenizers_words():
    """A WordLevel vocabulary without an unknown token raised a bare Exception on a word it
    lacks: HTTP 500, and a traceback from `graphmode generate --prompt`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from graphmode.errors import GraphmodeError
    from graphmode.serve.errors import openai_status
    t = Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2}))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    no_unk = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>")
    assert parse({"prompt": "a b"}, no_unk).prompts == [[0, 1]]
    with pytest.raises(GraphmodeError, match="tokenizer cannot encode this text: .*Missing") as e:
        parse({"prompt": "a zzz"}, no_unk)
    assert e.value.where == "prompt" and "token ids" in e.value.fix and openai_status(e.value) == 400
    with pytest.raises(GraphmodeError, match="cannot encode") as e:
        render(no_unk, [{"role": "user", "content": "zzz"}])
    assert e.value.where == "messages"


def test_a_tokenizer_giving_no_ids_for_text_is_named():
    """Trial AI: a folder whose tokenizer transformers loads as another class encoded "w5 w9" to
    [], and `graphmode generate` said 'no token ids: give at least one token'."""
    from graphmode.decode.output import encode_text
    from graphmode.errors import GraphmodeError

    class Empty:
        def encode(self, text, **_):
            return []
    with pytest.raises(GraphmodeError, match=r"tokenizer \(Empty\) gives no token ids") as e:
        encode_text(Empty(), "w5 w9", "--prompt")
    assert e.value.where == "--prompt" and "tokenizer_class" in e.value.fix
    assert encode_text(Empty(), "  ", "prompt") == []           # blank text: the caller's own refusal


def feed(out: ChoiceOutput, tokens: list[int], reason: str | None = None) -> tuple[list[int], str]:
    out.tokens += tokens
    return out.release(reason)


def test_a_stop_sequence_is_held_back_while_it_may_match_and_never_shown(tok):
    out = ChoiceOutput(0, tok, (), ((7, 8),))
    assert feed(out, [5, 6]) == ([5, 6], "w5 w6")
    assert feed(out, [7]) == ([], "")                             # may start the stop sequence
    assert feed(out, [9]) == ([7, 9], " w7 w9")                   # it did not
    assert feed(out, [7]) == ([], "")
    assert feed(out, [8]) == ([], "")                             # a whole match: the engine's "stop" follows
    assert feed(out, [], "stop") == ([], "") and out.finish_reason == "stop"
    single = ChoiceOutput(0, tok, (), ((9,),))                    # stop_token_ids: a match of one token
    assert feed(single, [5, 9]) == ([5], "w5")
    assert feed(single, [], "stop") == ([], "") and single.finish_reason == "stop"
    eos = ChoiceOutput(0, tok, (), ())
    assert feed(eos, [5, EOS], "eos") == ([5, EOS], "w5") and eos.finish_reason == "stop"
    assert ChoiceOutput(0, tok, (), ()).release("length") == ([], "")


def test_a_stop_string_ends_the_answer_at_the_token_that_completed_it(tok):
    out = ChoiceOutput(0, tok, (" w12",), ())
    assert feed(out, [5, 6]) == ([5, 6], "w5 w6")
    # the token after the stop arrived in the same wake-up: it is not part of the answer
    assert feed(out, [12, 13, 14]) == ([12], "") and out.finish_reason == "stop" and out.tokens == [5, 6, 12]
    held = ChoiceOutput(0, tok, ("w5 w6 w7",), ())
    assert feed(held, [5]) == ([5], "") and feed(held, [6]) == ([6], "")     # text that may start the stop
    assert feed(held, [8]) == ([8], "w5 w6 w8")
    assert feed(held, [5, 6, 7], None) == ([5, 6, 7], " ") and held.finish_reason == "stop"


MESSAGES = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w7 w8 w9"}]


def test_chat_template_from_the_tokenizer_or_the_default(tok):
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, unk_token="<unk>", eos_token="</s>")
    default = render(tok, MESSAGES)
    assert tok.decode(default) == "<unk> w5 w6 <unk> w7 w8 w9 <unk>"        # "system: ...\nuser: ...\nassistant:"
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
    assert render(tok, MESSAGES) == [5, 6, 7, 8, 9, 3]
    assert render(tok, MESSAGES, add_generation_prompt=False) == [5, 6, 7, 8, 9]


def test_a_stop_string_counts_only_from_min_tokens_on(tok):
    out = ChoiceOutput(0, tok, (" w12",), (), min_tokens=3)
    assert feed(out, [5, 12]) == ([5, 12], "w5 w12")              # " w12" before 3 tokens: text, not a stop (vLLM)
    assert feed(out, [13]) == ([13], " w13") and out.finish_reason is None
    assert feed(out, [12]) == ([12], "") and out.finish_reason == "stop"


def test_include_stop_str_in_output_keeps_the_matched_stop(tok):
    """vLLM's include_stop_str_in_output: the stop string (or stop sequence) that ended the
    answer stays in its text and tokens."""
    assert parse({"prompt": [5], "include_stop_str_in_output": True}).keep_stop
    assert not parse({"prompt": [5]}).keep_stop
    out = ChoiceOutput(0, tok, (" w12",), (), keep_stop=True)
    assert feed(out, [5, 6]) == ([5, 6], "w5 w6")
    assert feed(out, [12, 13]) == ([12], " w12") and out.finish_reason == "stop"
    ids = ChoiceOutput(0, tok, (), ((7, 8),), keep_stop=True)
    assert feed(ids, [5, 7, 8]) == ([5], "w5")                   # held while it may be the stop
    assert feed(ids, [], "stop") == ([7, 8], " w7 w8") and ids.finish_reason == "stop"


def test_chat_template_options_as_vllm_takes_them(tok):
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, unk_token="<unk>", eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% if not loop.last or not open %} w3 {% endif %}"
                         "{% endfor %}{% if add_generation_prompt %}w4{% endif %}{% if thinking %} w9{% endif %}")
    turns = MESSAGES + [{"role": "assistant", "content": "w10 w11"}]
    closed = render(tok, turns, add_generation_prompt=False)
    assert closed == [5, 6, 3, 7, 8, 9, 3, 10, 11, 3]
    # continue_final_message: the last message left open (transformers cuts after its content)
    assert render(tok, turns, False, True) == [5, 6, 3, 7, 8, 9, 3, 10, 11]
    assert render(tok, MESSAGES, True, False, {"thinking": True})[-1] == 9
    r = chat({"messages": turns, "add_generation_prompt": False, "continue_final_message": True, "echo": True,
              "chat_template_kwargs": {"thinking": False}}, tok)
    assert r.prompts[0] == [5, 6, 3, 7, 8, 9, 3, 10, 11] and r.echo_text == "w10 w11"
    assert chat({"messages": MESSAGES, "echo": True}, tok).echo_text == ""      # the last message is the user's
    for doc, needle in (({"continue_final_message": True}, "cannot both be true"),
                        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "request's own fields"),
                        ({"chat_template_kwargs": [1]}, "must map")):
        with pytest.raises(BadRequest, match=needle):
            chat({"messages": turns, **doc}, tok)


def test_an_empty_prompt_is_called_empty(tok):
    """It was told a prompt "must be a string, a list of strings, a list of token ids or ...",
    which an empty list of token ids is; an empty text got another code (the engine's
    contract_input) than the empty id list (bad_parameter)."""
    for doc in ({"prompt": []}, {"prompt": ""}, {"prompt": ["w5", " "]}):
        with pytest.raises(BadRequest) as e:
            parse(doc, tok)
        assert "the prompt is empty" in e.value.message and e.value.where == "prompt", doc


def test_skip_special_tokens_false_keeps_them_in_the_text(tok):
    """vLLM clients send skip_special_tokens (a 400 'unknown field'); false keeps </s> in the text."""
    assert parse({"prompt": [5]}).skip_special and not parse({"prompt": [5], "skip_special_tokens": False}).skip_special
    with pytest.raises(BadRequest, match="skip_special_tokens"):
        parse({"prompt": [5], "skip_special_tokens": "no"})
    texts = []
    for skip in (True, False):
        out = ChoiceOutput(0, tok, (), (), skip_special=skip)
        texts.append(feed(out, [5, EOS, 6], "length")[1])
    assert "</s>" not in texts[0] and "</s>" in texts[1] and "w5" in texts[0]


def test_an_assistant_message_echoed_with_empty_tool_calls_is_taken(tok):
    """Clients send the assistant's previous answer back as they got it: "tool_calls": [] was a 400."""
    msgs = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6", "tool_calls": [],
                                                "function_call": None}, {"role": "user", "content": "w7"}]
    from graphmode.serve.openai_request import parse_messages
    assert parse_messages(msgs)[1] == {"role": "assistant", "content": "w6"}
    with pytest.raises(BadRequest, match="tool_calls"):
        parse_messages([dict(msgs[1], tool_calls=[{"id": "x"}])])
