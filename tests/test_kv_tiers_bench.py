"""client/tools/benchmarks/kv_tiers.py's workload: `--document-tokens` opens each conversation's first
message with a document of its own (the long per-conversation histories issue 47 asks the tiers
to be measured on), of exactly that many tokens; the later turns are as before."""
import random

from client.tools.benchmarks.kv_tiers import user_turns


class Words:
    """A tokenizer of one token a word (what user_turns needs: encode)."""

    def encode(self, text, add_special_tokens=True):
        return [hash(w) % 50000 for w in text.split()]


def test_each_conversation_opens_with_its_own_document():
    plain = user_turns(Words(), random.Random(3), 5, 3, 4, 9)
    docs = user_turns(Words(), random.Random(3), 5, 3, 4, 9, document=700)
    firsts = [turns[0] for turns in docs]
    assert all(len(first) >= 700 + 4 for first in firsts)
    assert len({tuple(first[:700]) for first in firsts}) == 5          # no two conversations share it
    assert all(len(turns[1]) <= 9 and len(turns[2]) <= 9 for turns in docs)
    assert all(len(turns[0]) <= 9 for turns in plain)
