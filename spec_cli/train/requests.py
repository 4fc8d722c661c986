"""Requests the target answers to make a draft head's training data: chat, writing, questions, summaries and code,
written for this tool (none is in the built-in prompt sets: a test checks it), each a template filled with a
subject. Requests are split by a hash of their text: held-out ones are never trained on, and the acceptance
estimate is measured on the target's answers to them.
"""

from __future__ import annotations

import random
import zlib

HELD_OUT_MOD = 10  # one request in ten (by text hash) is held out

SUBJECTS = (
    "a bakery that only opens at night", "learning to play the cello at forty", "a city without cars",
    "moving to a small island", "the first day at a new job", "a robot that collects old maps",
    "a garden on a rooftop", "a long train journey through the mountains", "keeping bees in the city",
    "a library that lends tools", "winter in a fishing village", "a friendship between two rival chess players",
    "repairing an old bicycle", "a museum of forgotten inventions", "a power cut during a storm",
    "planning a surprise party", "a teacher's last day before retirement", "the smell of rain on hot stone",
    "a lost dog finding its way home", "a festival of lanterns", "running a marathon for the first time",
    "a village choir", "a map with one island too many", "living on a houseboat", "a kitchen full of spices",
    "an astronaut's letter home", "a market at dawn", "restoring a piano", "a quiet cafe in a busy street",
    "the history of the umbrella", "saving water at home", "a lighthouse that turns itself off",
)
TOPICS = (
    "photosynthesis", "compound interest", "the water cycle", "how vaccines train the immune system",
    "why the sky is blue", "how a refrigerator keeps food cold", "the difference between weather and climate",
    "how tides work", "what inflation is", "how a bill becomes a law", "the causes of the seasons",
    "how noise-cancelling headphones work", "why bread rises", "what a black hole is", "how GPS finds a position",
    "the rules of chess castling", "how solar panels make electricity", "what a credit score measures",
    "how bees communicate", "the difference between a virus and a bacterium", "how an electric motor turns",
    "why ice floats", "what a carbon footprint is", "how to read a nutrition label",
    "how recycling of plastic works", "the basics of supply and demand", "how earthquakes are measured",
    "why leaves change colour in autumn", "how a microwave oven heats food", "what makes a good night's sleep",
)
CODE_TASKS = (
    "checks whether a string is a palindrome, ignoring case and punctuation",
    "merges two sorted lists into one sorted list", "counts the words in a text file",
    "returns the n-th Fibonacci number iteratively", "removes duplicates from a list while keeping the order",
    "parses a date like 2024-03-17 and returns the weekday", "flattens a nested list of any depth",
    "finds the longest common prefix of a list of strings", "converts a Roman numeral to an integer",
    "groups a list of words by their first letter", "computes the moving average of a list of numbers",
    "validates an email address with a simple regular expression", "reads a CSV file and sums one column",
    "implements binary search on a sorted list", "rotates a matrix by 90 degrees",
    "checks whether two strings are anagrams", "returns the prime numbers below n with a sieve",
    "formats a number of seconds as hours, minutes and seconds", "chunks a list into pieces of size k",
    "computes the factorial of n recursively", "reverses the words of a sentence",
    "finds the most common element of a list", "converts a temperature between Celsius and Fahrenheit",
    "implements a stack class with push, pop and peek", "counts the vowels in a string",
    "transposes a list of lists", "checks whether brackets in a string are balanced",
    "returns the intersection of two lists", "generates all subsets of a small set",
    "computes the greatest common divisor of two numbers",
)
LANGUAGES = ("Python", "JavaScript", "Go", "Rust", "Java", "C")
TEMPLATES = {
    "writing": (
        ("Write a short story about {s}.", SUBJECTS), ("Write a poem about {s}.", SUBJECTS),
        ("Write a diary entry from someone experiencing {s}.", SUBJECTS),
        ("Write a short speech for the opening of {s}.", SUBJECTS),
        ("Write a newspaper column about {s}.", SUBJECTS),
        ("Write the opening paragraph of a novel about {s}.", SUBJECTS),
        ("Write a friendly letter to a neighbour about {s}.", SUBJECTS),
        ("Write a product description for a board game about {s}.", SUBJECTS),
    ),
    "chat": (
        ("I'm thinking about {s}. Can you give me some advice?", SUBJECTS),
        ("What would be a fun weekend plan involving {s}?", SUBJECTS),
        ("My friend keeps talking about {s}. What questions could I ask them?", SUBJECTS),
        ("Can you help me make a checklist for {s}?", SUBJECTS),
        ("Tell me something interesting about {t}.", TOPICS),
        ("I never understood {t}. Could you help?", TOPICS),
    ),
    "question": (
        ("Explain {t} in simple terms.", TOPICS), ("Explain {t} to a ten-year-old.", TOPICS),
        ("What are the most common misconceptions about {t}?", TOPICS),
        ("Give a step-by-step explanation of {t}.", TOPICS),
        ("Answer briefly: what should everyone know about {t}?", TOPICS),
    ),
    "summary": (
        ("Summarize in five bullet points what a beginner should know about {t}.", TOPICS),
        ("Write a one-paragraph summary of {t} for a school textbook.", TOPICS),
        ("Summarize the pros and cons of {s}.", SUBJECTS),
    ),
    "code": (
        ("Write a Python function that {c}. Include a docstring.", CODE_TASKS),
        ("Write a {l} function that {c}, with a short explanation.", None),
        ("Write unit tests for a Python function that {c}.", CODE_TASKS),
        ("Explain how you would write a function that {c}, then write it in Python.", CODE_TASKS),
    ),
}


def all_requests() -> list[str]:
    """Every request text, in a fixed order."""
    out = []
    for kind in TEMPLATES.values():
        for template, fills in kind:
            if fills is None:  # the other languages' code tasks
                out += [template.format(l=lang, c=task) for lang in LANGUAGES[1:] for task in CODE_TASKS]
            else:
                key = "s" if "{s}" in template else "t" if "{t}" in template else "c"
                out += [template.format(**{key: f}) for f in fills]
    return out


def is_held_out(text: str) -> bool:
    return zlib.crc32(text.encode()) % HELD_OUT_MOD == 0


def requests(n: int, held_out: bool, rng: random.Random) -> list[str]:
    """n requests (repeating the list's shuffled order when n is larger), held-out ones or the others."""
    pool = [r for r in all_requests() if is_held_out(r) == held_out]
    rng.shuffle(pool)
    return [pool[i % len(pool)] for i in range(n)]
