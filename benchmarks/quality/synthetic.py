"""A small synthetic dataset in the LoCoMo layout (the real file is not shipped): a few two-speaker
conversations over two sessions, observation facts with their evidence turns, and questions of every
category. Deterministic; `python -m benchmarks.quality.synthetic --out data.json` writes it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PEOPLE = [
    {
        "a": "Maya",
        "b": "Sam",
        "pet": "a grey cat named Pixel",
        "pet_short": "Pixel",
        "city": "Lisbon",
        "job": "a nurse",
        "hobby": "rock climbing",
        "trip": "Kyoto",
        "month": "May",
        "sister": "Lena",
        "food": "ramen",
    },
    {
        "a": "Omar",
        "b": "Ines",
        "pet": "a beagle named Biscuit",
        "pet_short": "Biscuit",
        "city": "Toronto",
        "job": "a carpenter",
        "hobby": "chess",
        "trip": "Reykjavik",
        "month": "March",
        "sister": "Dalia",
        "food": "tacos",
    },
    {
        "a": "Keiko",
        "b": "Luis",
        "pet": "a parrot named Mango",
        "pet_short": "Mango",
        "city": "Osaka",
        "job": "a teacher",
        "hobby": "pottery",
        "trip": "Lima",
        "month": "October",
        "sister": "Yumi",
        "food": "dumplings",
    },
]


def sample(i: int, p: dict) -> dict:
    a, b = p["a"], p["b"]
    s1 = [
        (a, f"Hi {b}! I finally settled in {p['city']} last week."),
        (b, "That's great, how is the new place?"),
        (a, f"Lovely. I work as {p['job']} at the hospital district now."),
        (b, "Busy job! Any time for fun?"),
        (a, f"Weekends are for {p['hobby']}, and for {p['pet']} of course."),
        (b, "Ha, I'd love to meet your pet."),
    ]
    s2 = [
        (b, f"How was your month, {a}?"),
        (a, f"Good! My sister {p['sister']} visited and we ate {p['food']} every day."),
        (b, "Sounds delicious. Any plans?"),
        (a, f"I'm flying to {p['trip']} in {p['month']} for two weeks."),
        (b, f"Will {p['pet_short']} come along?"),
        (a, f"No, {p['sister']} will look after {p['pet_short']} while I travel."),
    ]
    conversation = {
        "speaker_a": a,
        "speaker_b": b,
        "session_1_date_time": "1:00 pm on 3 March, 2026",
        "session_2_date_time": "6:30 pm on 20 April, 2026",
    }
    for n, turns in ((1, s1), (2, s2)):
        conversation[f"session_{n}"] = [
            {"speaker": s, "dia_id": f"D{n}:{j + 1}", "text": t} for j, (s, t) in enumerate(turns)
        ]
    observation = {
        "session_1_observation": {
            a: [
                [f"{a} moved to {p['city']}.", "D1:1"],
                [f"{a} works as {p['job']}.", "D1:3"],
                [f"{a} enjoys {p['hobby']} on weekends.", "D1:5"],
                [f"{a} has {p['pet']}.", "D1:5"],
            ]
        },
        "session_2_observation": {
            a: [
                [f"{a}'s sister {p['sister']} visited and they ate {p['food']}.", "D2:2"],
                [f"{a} will travel to {p['trip']} in {p['month']}.", "D2:4"],
                [f"{p['sister']} will look after {p['pet_short']} during the trip.", ["D2:6", "D1:5"]],
            ]
        },
    }
    qa = [
        {"question": f"Which city did {a} move to?", "answer": p["city"], "evidence": ["D1:1"], "category": 4},
        {"question": f"What is the name of {a}'s pet?", "answer": p["pet_short"], "evidence": ["D1:5"], "category": 4},
        {
            "question": f"What does {a} do for work?",
            "answer": p["job"].split(" ", 1)[1],
            "evidence": ["D1:3"],
            "category": 4,
        },
        {
            "question": f"Who will look after {a}'s pet, and where is {a} travelling?",
            "answer": f"{p['sister']}, {p['trip']}",
            "evidence": ["D2:6", "D2:4"],
            "category": 1,
        },
        {"question": f"In which month will {a} travel?", "answer": p["month"], "evidence": ["D2:4"], "category": 2},
        {
            "question": f"What hobby might {a} enjoy on a holiday?",
            "answer": p["hobby"],
            "evidence": ["D1:5"],
            "category": 3,
        },
        {
            "question": f"What is the name of {a}'s brother?",
            "adversarial_answer": p["sister"],
            "evidence": [],
            "category": 5,
        },
    ]
    return {"sample_id": f"synthetic-{i}", "conversation": conversation, "observation": observation, "qa": qa}


def dataset() -> list[dict]:
    return [sample(i, p) for i, p in enumerate(PEOPLE)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(json.dumps(dataset(), indent=1))


if __name__ == "__main__":
    main()
