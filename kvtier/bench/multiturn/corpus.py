"""A deterministic document-plus-questions corpus: real English sentences, no download.

Each conversation has its own topic (a town, an organisation, a project) and an endless stream of
report sentences about it, drawn from fixed word banks by a `random.Random` seeded with a string
(`"<seed>:<tag>:<conversation>"`), so the same seed, tag and conversation give the same text in
any process on any machine. A user message is a slice of that stream (the next part of the
document) followed by a question about it; `kvtier.bench.multiturn.conversation` cuts the slice
to an exact token count.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

PLACES = ("Ashford", "Brindle Bay", "Calloway", "Dunmore", "Elmstead", "Fairhaven", "Glenrock",
          "Harrow Vale", "Inverleith", "Juniper Falls", "Kingsmere", "Lowther", "Millbrook",
          "Northcliff", "Oakridge", "Pembury", "Quarry Hill", "Redwater", "Stonebridge", "Thornbury")
SUBJECTS = ("the town council", "the harbour board", "the school governors", "the library trust",
            "the railway society", "the water company", "the farmers' cooperative",
            "the hospital committee", "the museum volunteers", "the planning office",
            "the cycling club", "the chamber of commerce", "the youth orchestra",
            "the flood defence team", "the allotment society", "the bus operator")
VERBS = ("approved", "postponed", "reviewed", "questioned", "funded", "redesigned", "inspected",
         "announced", "rejected", "extended", "completed", "proposed", "measured", "repaired",
         "surveyed", "published")
OBJECTS = ("the new footbridge", "the spring budget", "the northern car park", "a reading room",
           "the drainage plan", "the old signal box", "a community garden", "the market square",
           "the winter timetable", "the harbour wall", "a solar roof", "the river path",
           "the sports hall", "the annual report", "a tree planting scheme", "the ferry service")
REASONS = ("after a long public meeting", "because the costs had risen", "despite several objections",
           "following a survey of residents", "once the engineers had reported",
           "to reduce traffic near the school", "after heavy rain in the autumn",
           "with a grant from the county", "before the tourist season", "to save energy",
           "because the contractor was late", "after a vote of nine to four")
DETAILS = ("The work is expected to take {n} months.", "About {n} residents attended the meeting.",
           "The estimate was {n} thousand pounds.", "A further review is planned in {n} weeks.",
           "The project employs {n} local workers.", "Some {n} letters of support were received.",
           "The previous plan had been delayed for {n} years.",
           "The site lies {n} minutes from the station on foot.")
QUESTIONS = ("What did {s} decide about {o}, and why?", "Summarise what the report says about {o}.",
             "Which groups were involved with {o}, according to the text?",
             "What problems with {o} does the document mention?",
             "How long will the work on {o} take, based on the report?",
             "What would you ask {s} about {o} at the next meeting?")


def rng_for(seed: int, tag: str, conversation: int) -> random.Random:
    """The generator of one conversation's text; string seeding is stable across processes."""
    return random.Random(f"{seed}:{tag}:{conversation}")


def sentences(rng: random.Random) -> Iterator[str]:
    """An endless report about one place, one sentence at a time."""
    place = rng.choice(PLACES)
    yield f"This report describes recent decisions in {place}."
    while True:
        subject, obj = rng.choice(SUBJECTS), rng.choice(OBJECTS)
        text = f"In {place}, {subject} {rng.choice(VERBS)} {obj} {rng.choice(REASONS)}."
        yield text[0].upper() + text[1:]
        if rng.random() < 0.6:
            yield rng.choice(DETAILS).format(n=rng.randint(2, 90))


def words(rng: random.Random) -> Iterator[str]:
    """The report as a stream of words (punctuation attached), to be joined with spaces."""
    for sentence in sentences(rng):
        yield from sentence.split(" ")


def question(rng: random.Random) -> str:
    """A question about the report, mentioning one of its subjects and objects."""
    return rng.choice(QUESTIONS).format(s=rng.choice(SUBJECTS), o=rng.choice(OBJECTS))
