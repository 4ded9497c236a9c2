"""A lane rank with a stand-in engine, for the launcher's multi-rank tests while the glm53 engine
serves one rank only (its follow() for world > 1 comes with the layout work). Everything but the
engine is the real rank (glm53.serving.rank: progress, memory guard, port binding, the HTTP front).

`GLM53_RANK_MODULE=tests.standin_rank bash serve.sh --local --ranks 3 --model TINY`.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from glm53.serving.front.chat import ChatText  # noqa: E402
from glm53.serving.rank import main  # noqa: E402
from lane_fixtures import StandInEngine  # noqa: E402


class FollowingStandIn(StandInEngine):
    def follow(self) -> None:  # a follower waits for rank 0's work; here: forever, until stopped
        threading.Event().wait()


def engine(args):
    text = ChatText(args.model)
    return FollowingStandIn(vocab=text.tokenizer.get_vocab_size(), eos=0, delay=0.02)


if __name__ == "__main__":
    sys.exit(main(engine_factory=engine, sampling_factory=dict))
