"""A development set large enough to tell memory configurations apart, in the LoCoMo layout, generated.

The three-conversation set of `synthetic.py` has 21 questions: every F1 difference between two configurations
of injection is inside its noise. This one is drawn from a seed: `conversations` two-speaker conversations of
five dated sessions each, both speakers with lives of their own (so the facts of one are distractors for the
other), and ~30 questions a conversation over every category: single-hop (one fact), multi-hop (facts of
different sessions linked: a person introduced in one, what they did in another), temporal (dates stated in
the conversation; a move that replaces an earlier home, so the latest fact is the answer), open-domain (an
inference from a stated preference) and adversarial (asked about what was never said, with the tempting wrong
answer). Same seed, same file; nothing is downloaded.

    python -m benchmarks.quality.devset --out dev.json [--conversations 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

FIRST_NAMES = [
    "Maya",
    "Sam",
    "Omar",
    "Ines",
    "Keiko",
    "Luis",
    "Priya",
    "Tomas",
    "Amara",
    "Felix",
    "Nadia",
    "Jonas",
    "Leila",
    "Marco",
    "Sofia",
    "Ravi",
    "Elena",
    "Kwame",
    "Hana",
    "Diego",
    "Zara",
    "Ivan",
    "Lucia",
    "Theo",
]
CITIES = [
    "Lisbon",
    "Toronto",
    "Osaka",
    "Lima",
    "Nairobi",
    "Oslo",
    "Porto",
    "Denver",
    "Seoul",
    "Krakow",
    "Perth",
    "Bogota",
    "Dublin",
    "Tunis",
    "Hanoi",
    "Quito",
    "Leeds",
    "Adelaide",
]
JOBS = [
    "nurse",
    "carpenter",
    "teacher",
    "pharmacist",
    "architect",
    "baker",
    "pilot",
    "librarian",
    "electrician",
    "veterinarian",
    "journalist",
    "plumber",
    "chemist",
    "translator",
]
PETS = [
    ("cat", "Pixel"),
    ("beagle", "Biscuit"),
    ("parrot", "Mango"),
    ("rabbit", "Clover"),
    ("tortoise", "Atlas"),
    ("husky", "Juniper"),
    ("hamster", "Nugget"),
    ("goldfish", "Bubbles"),
    ("poodle", "Waffles"),
    ("ferret", "Ziggy"),
]
HOBBIES = [
    ("rock climbing", "climbing gym"),
    ("pottery", "ceramics studio"),
    ("chess", "chess club"),
    ("kayaking", "river"),
    ("birdwatching", "nature reserve"),
    ("salsa dancing", "dance school"),
    ("astronomy", "observatory"),
    ("woodworking", "workshop"),
    ("cycling", "velodrome"),
    ("painting", "art class"),
]
INSTRUMENTS = ["cello", "banjo", "trumpet", "harp", "saxophone", "ukulele", "violin", "accordion", "drums", "flute"]
FOODS = ["ramen", "tacos", "dumplings", "paella", "curry", "pierogi", "falafel", "risotto", "pho", "empanadas"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
COMPANIES = ["Northwind", "Bluepeak", "Larkspur", "Orchid Labs", "Ironbridge", "Seabright", "Copperleaf", "Redfern"]
RELATIVES = ["sister", "brother", "cousin", "aunt", "uncle", "grandmother"]
# small facts (turn, observation, question, answer key) that fill each session: retrieval must pick among them
MINOR = [
    (
        "I am learning {language} in the evenings.",
        "{a} is learning {language}.",
        "Which language is {a} learning?",
        "language",
    ),
    ("I finally read {book}; I could not put it down.", "{a} read {book}.", "Which book did {a} read?", "book"),
    (
        "I painted my kitchen {colour} last week.",
        "{a} painted the kitchen {colour}.",
        "What colour is {a}'s kitchen?",
        "colour",
    ),
    (
        "I planted {plant} on my balcony.",
        "{a} planted {plant} on the balcony.",
        "What did {a} plant on the balcony?",
        "plant",
    ),
    ("I ran a {race} race on Sunday.", "{a} ran a {race} race.", "What race did {a} run?", "race"),
    (
        "I bought a used {vehicle} to get around.",
        "{a} bought a used {vehicle}.",
        "What did {a} buy to get around?",
        "vehicle",
    ),
    (
        "My favourite film this year is {film}.",
        "{a}'s favourite film this year is {film}.",
        "What is {a}'s favourite film this year?",
        "film",
    ),
    (
        "I joined a {club} on Tuesdays.",
        "{a} joined a {club} that meets on Tuesdays.",
        "What did {a} join on Tuesdays?",
        "club",
    ),
]
MINOR_VALUES = {
    "language": ["Portuguese", "Japanese", "Swahili", "Polish", "Korean", "Italian", "Turkish", "Dutch"],
    "book": ["The Glass Orchard", "Salt and Cedar", "A Map of Small Rivers", "The Ninth Lantern", "Copper Skies"],
    "colour": ["sage green", "mustard yellow", "navy blue", "terracotta", "lavender", "coral"],
    "plant": ["tomatoes", "basil", "sunflowers", "strawberries", "chillies", "lavender bushes"],
    "race": ["ten kilometre", "half marathon", "five kilometre", "trail", "relay"],
    "vehicle": ["scooter", "tandem bike", "camper van", "hatchback", "cargo bike"],
    "film": ["Harbour Lights", "The Last Glacier", "Paper Moons", "Night Train to Vigo", "Quiet Engines"],
    "club": ["book club", "choir", "running club", "quiz team", "volunteer group"],
}
# small talk that is remembered but never asked about (the haystack retrieval searches)
CHATTER = [
    "I had {meal} with a colleague on {day}.",
    "It rained all {day}, so I stayed in and baked {bake}.",
    "I fixed the {thing} in my flat on {day}.",
    "On {day} I walked along the {place} for an hour.",
    "I tried a new {meal} place near work on {day}.",
    "I spent {day} sorting old {thing} boxes.",
    "A neighbour lent me a {thing} on {day}.",
    "I watched the {place} fireworks on {day}.",
]
CHATTER_VALUES = {
    "meal": ["lunch", "breakfast", "dinner", "brunch"],
    "day": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Sunday"],
    "bake": ["bread", "scones", "a lemon cake", "cookies"],
    "thing": ["heater", "bookshelf", "window", "ladder", "lamp"],
    "place": ["canal", "seafront", "park", "old town"],
}
SESSION_GAP_DAYS = (9, 23)
BEGIN_YEAR = 2026


@dataclass
class _Person:
    name: str
    city: str
    new_city: str
    job: str
    company: str
    pet: tuple[str, str]
    hobby: tuple[str, str]
    food: str
    relative: tuple[str, str]  # (relation, name)
    friend: str
    friend_instrument: str
    friend_city: str
    trip: str
    trip_month: str
    missing_relation: str  # a relation never mentioned (adversarial questions ask about it)


@dataclass
class _Conversation:
    """Turns per session, observations per session and speaker, and questions, as they are written."""

    sessions: list[list[tuple[str, str]]] = field(default_factory=lambda: [[] for _ in range(5)])
    observations: list[dict[str, list]] = field(default_factory=lambda: [{} for _ in range(5)])
    qa: list[dict] = field(default_factory=list)

    def say(self, session: int, speaker: str, text: str) -> str:
        """Add a turn; its dialogue id."""
        self.sessions[session].append((speaker, text))
        return f"D{session + 1}:{len(self.sessions[session])}"

    def observe(self, session: int, speaker: str, fact: str, evidence: str | list[str]) -> None:
        self.observations[session].setdefault(speaker, []).append([fact, evidence])

    def ask(self, question: str, answer: str, evidence: list[str], category: int) -> None:
        key = "adversarial_answer" if category == 5 else "answer"
        self.qa.append({"question": question, key: answer, "evidence": evidence, "category": category})


def _dates(rng: random.Random) -> list[tuple[int, int, int]]:
    """(day, month index, year) of five sessions, a few weeks apart."""
    day, month, year, out = rng.randint(1, 20), rng.randint(0, 5), BEGIN_YEAR, []
    for _ in range(5):
        out.append((day, month, year))
        day += rng.randint(*SESSION_GAP_DAYS)
        while day > 28:
            day, month = day - 28, month + 1
        if month > 11:
            month, year = month - 12, year + 1
    return out


def _person(rng: random.Random, name: str, friend: str, taken: set[str]) -> _Person:
    def pick(pool):
        choice = rng.choice([x for x in pool if str(x) not in taken])
        taken.add(str(choice))
        return choice

    relation = rng.choice(RELATIVES)
    return _Person(
        name=name,
        city=pick(CITIES),
        new_city=pick(CITIES),
        job=pick(JOBS),
        company=pick(COMPANIES),
        pet=pick(PETS),
        hobby=pick(HOBBIES),
        food=pick(FOODS),
        relative=(relation, pick(FIRST_NAMES)),
        friend=friend,
        friend_instrument=pick(INSTRUMENTS),
        friend_city=pick(CITIES),
        trip=pick(CITIES),
        trip_month=rng.choice(MONTHS),
        missing_relation=rng.choice([r for r in RELATIVES if r != relation]),
    )


def _an(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _date_text(date: tuple[int, int, int]) -> str:
    return f"{date[0]} {MONTHS[date[1]]} {date[2]}"


def _life(c: _Conversation, p: _Person, other: str, dates: list[tuple[int, int, int]], rng: random.Random) -> None:
    """One speaker's facts over the five sessions, the other speaker answering, and the questions about them."""
    a = p.name
    relation, relative = p.relative
    species, pet = p.pet
    hobby, place = p.hobby
    home = c.say(0, a, f"I live in {p.city} these days, close to the old harbour.")
    c.say(0, other, "Nice, I have heard good things about it.")
    work = c.say(0, a, f"I work as {_an(p.job)} at {p.company}; the shifts are long but I like the team.")
    c.observe(0, a, f"{a} lives in {p.city}.", home)
    c.observe(0, a, f"{a} works as {_an(p.job)} at {p.company}.", work)
    adopted_day = dates[1][0] - rng.randint(1, min(6, dates[1][0] - 1)) if dates[1][0] > 1 else 1
    adopted = (adopted_day, dates[1][1], dates[1][2])
    pet_turn = c.say(1, a, f"Big news: on {_date_text(adopted)} I adopted a {species} and named it {pet}.")
    c.say(1, other, f"{pet} is a lovely name!")
    hobby_turn = c.say(1, a, f"I also started {hobby}; I go to the {place} every Saturday.")
    c.observe(1, a, f"{a} adopted a {species} named {pet} on {_date_text(adopted)}.", pet_turn)
    c.observe(1, a, f"{a} took up {hobby} and goes to the {place} every Saturday.", hobby_turn)
    friend_turn = c.say(2, a, f"At the {place} I met {p.friend}, who grew up in {p.friend_city}.")
    c.say(2, other, f"Does {p.friend} do anything else?")
    music_turn = c.say(2, a, f"{p.friend} plays the {p.friend_instrument} in a small band.")
    visit_turn = c.say(2, a, f"My {relation} {relative} visited last weekend and we cooked {p.food} every night.")
    c.observe(2, a, f"{a} met {p.friend} at the {place}; {p.friend} grew up in {p.friend_city}.", friend_turn)
    c.observe(2, a, f"{p.friend} plays the {p.friend_instrument} in a band.", music_turn)
    c.observe(2, a, f"{a}'s {relation} {relative} visited and they cooked {p.food}.", visit_turn)
    moved = (max(1, dates[3][0] - rng.randint(0, 5)), dates[3][1], dates[3][2])
    move_turn = c.say(3, a, f"I moved from {p.city} to {p.new_city} on {_date_text(moved)}, a new job offer.")
    c.say(3, other, "A big change! Good luck there.")
    trip_turn = c.say(3, a, f"In {p.trip_month} I will fly to {p.trip} for two weeks.")
    c.observe(3, a, f"{a} moved from {p.city} to {p.new_city} on {_date_text(moved)}.", move_turn)
    c.observe(3, a, f"{a} will travel to {p.trip} in {p.trip_month}.", trip_turn)
    sitter_turn = c.say(4, a, f"{relative} will look after {pet} while I am in {p.trip}.")
    c.say(4, other, f"{pet} will be in good hands.")
    c.observe(4, a, f"{relative} will look after {pet} during {a}'s trip to {p.trip}.", [sitter_turn, pet_turn])

    for i, (turn, fact, question, key) in enumerate(rng.sample(MINOR, len(MINOR))):
        value = rng.choice(MINOR_VALUES[key])
        said = c.say(i % 5, a, turn.format(**{key: value}))
        c.observe(i % 5, a, fact.format(a=a, **{key: value}), said)
        if i < 2:
            c.ask(question.format(a=a), value, [said], 4)
    for i in range(10):
        line = rng.choice(CHATTER).format(**{k: rng.choice(v) for k, v in CHATTER_VALUES.items()})
        said = c.say(i % 5, a, line)
        c.observe(i % 5, a, f'{a} mentioned: "{line}"', said)

    c.ask(f"What is the name of {a}'s {species}?", pet, [pet_turn], 4)
    c.ask(f"What does {a} do for work?", p.job, [work], 4)
    c.ask(f"Which company does {a} work for?", p.company, [work], 4)
    c.ask(f"What instrument does {p.friend} play?", p.friend_instrument, [music_turn], 4)
    c.ask(f"Which food did {a} cook with {relative}?", p.food, [visit_turn], 4)
    c.ask(f"Where is {a} travelling in {p.trip_month}?", p.trip, [trip_turn], 4)
    c.ask(
        f"What instrument does the friend {a} met at the {place} play?",
        p.friend_instrument,
        [friend_turn, music_turn],
        1,
    )
    c.ask(
        f"Who will look after {a}'s {species}, and where is {a} going?",
        f"{relative}, {p.trip}",
        [sitter_turn, trip_turn],
        1,
    )
    c.ask(f"Where did the friend {a} met through {hobby} grow up?", p.friend_city, [hobby_turn, friend_turn], 1)
    c.ask(f"When did {a} adopt {pet}?", _date_text(adopted), [pet_turn], 2)
    c.ask(f"When did {a} move to {p.new_city}?", _date_text(moved), [move_turn], 2)
    c.ask(f"Which city does {a} live in now?", p.new_city, [home, move_turn], 2)
    c.ask(f"What might {a} enjoy doing on a free Saturday?", hobby, [hobby_turn], 3)
    c.ask(f"What kind of animal would {a} be happy to talk about?", species, [pet_turn], 3)
    c.ask(f"What is the name of {a}'s {p.missing_relation}?", relative, [], 5)
    c.ask(f"Which instrument does {a} play?", p.friend_instrument, [], 5)


def conversation(index: int, seed: int) -> dict:
    """One sample: two speakers, five dated sessions, both speakers' facts and ~30 questions."""
    rng = random.Random(seed * 100_003 + index)
    a, b, friend_a, friend_b = rng.sample(FIRST_NAMES, 4)
    taken = {a, b, friend_a, friend_b}
    people = [_person(rng, a, friend_a, taken), _person(rng, b, friend_b, taken)]
    dates = _dates(rng)
    c = _Conversation()
    for session in range(5):
        c.say(session, b, f"Hey {a}, good to talk again!")
        c.say(session, a, f"Hi {b}! A lot happened since we last spoke.")
    for person, other in ((people[0], b), (people[1], a)):
        _life(c, person, other, dates, rng)
    convo: dict = {"speaker_a": a, "speaker_b": b}
    for n, turns in enumerate(c.sessions, start=1):
        day, month, year = dates[n - 1]
        convo[f"session_{n}_date_time"] = f"{rng.randint(9, 20)}:00 on {day} {MONTHS[month]}, {year}"
        convo[f"session_{n}"] = [{"speaker": s, "dia_id": f"D{n}:{j + 1}", "text": t} for j, (s, t) in enumerate(turns)]
    observation = {f"session_{n}_observation": per for n, per in enumerate(c.observations, start=1)}
    return {"sample_id": f"dev-{seed}-{index}", "conversation": convo, "observation": observation, "qa": c.qa}


def dataset(conversations: int = 10, seed: int = 0) -> list[dict]:
    return [conversation(i, seed) for i in range(conversations)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.conversations < 1:
        parser.error("--conversations must be at least 1")
    args.out.write_text(json.dumps(dataset(args.conversations, args.seed), indent=1))


if __name__ == "__main__":
    main()
