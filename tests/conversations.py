"""Conversations shared by the model and engine tests, and the Maya memory encoded as records."""

import torch

from kvcore.conversation import Fact, Turn
from kvcore.encoding import EncodingJob, encode_jobs, plan_fact_jobs
from models.chat import TokenizerEncoder

MAYA = [
    Turn("Maya", "I moved to Porto in March for a job at the aquarium."),
    Turn("Assistant", "Congratulations! What will you work on?"),
    Turn("Maya", "Octopus behaviour. I also adopted a grey cat called Pixel."),
    Turn("Assistant", "Pixel is a great name."),
    Turn("Maya", "I am allergic to peanuts and I run half marathons."),
]


def maya_records(loaded, forward, frame) -> list:
    """Each Maya turn encoded behind all the turns before it (exact), then the frame's prefix record last."""
    facts = [Fact(f"turn{i}", t.render().rstrip("\n"), i) for i, t in enumerate(MAYA)]
    jobs = plan_fact_jobs(
        MAYA, facts, window=len(MAYA), prefix_ids=frame.prefix_ids, tokenizer=TokenizerEncoder(loaded.tokenizer)
    )
    jobs.append(EncodingJob("prefix", (), frame.prefix_ids))
    return encode_jobs(jobs, forward, loaded.spec, tenant_id="maya", window=len(MAYA), dtype=torch.float32)
