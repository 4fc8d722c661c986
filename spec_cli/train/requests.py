"""Requests the target answers to make a draft head's training data: chat (one turn, or a follow-up after an
earlier answer), writing, questions, summaries and code, each a template written for this tool filled with a subject
(none is in the built-in prompt sets: a test checks it), and questions about the documentation of standard-library
functions and classes. Template requests are split by a hash of their text, documentation ones by their module's
file as the code windows are (train/data.py): held-out ones are never trained on, and the acceptance estimate is
measured on the target's answers to them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import random
from dataclasses import dataclass
from pathlib import Path

from spec_cli.text.prompt_sets import quoted_stdlib_files
from spec_cli.train.data import is_held_out, stdlib_root


@dataclass(frozen=True)
class Request:
    turns: tuple[str, ...]  # user, assistant, user, ...: the target answers the last (user) turn
    held_out: bool


def templated(*turns: str) -> Request:
    """A request filled from templates, held out by a hash of its text."""
    return Request(turns, is_held_out("\n".join(turns)))

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
    "an old radio that picks up tomorrow's news", "a school trip to a glacier",
    "a chef who lost her sense of taste",
    "a town where it snows every Tuesday", "building a treehouse with a grandparent", "a night shift at a hospital",
    "a street musician's best day", "the last video shop in town", "a family reunion that goes wrong",
    "a hiking trail that changes every year", "learning to swim as an adult", "an island run by cats",
    "a detective who is afraid of the dark", "moving back to your hometown", "a bus driver who knows every passenger",
    "a forest fire seen from a distance", "a clock tower that runs backwards", "a farmer's market in the rain",
    "an apprentice glassblower", "a spaceship's tiny greenhouse", "selling lemonade on a hot day",
    "a painter who can only paint the sea", "a neighbourhood book swap", "the first snow of the year",
    "a bridge that connects two rival villages", "a grandmother's recipe box", "a ferry crossing in thick fog",
    "a robot learning to tell jokes", "volunteering at an animal shelter", "a letter that arrives fifty years late",
    "a tiny apartment with a huge window", "a soccer team with only nine players", "a campfire on the beach",
    "the night before a big exam", "a tailor who makes coats for giants", "an abandoned amusement park",
    "a mountain hut in a blizzard", "a town that bans mobile phones for a week", "a carpenter's workshop",
    "a wedding in a thunderstorm", "a kite festival", "the first person to live on Mars",
    "a bakery competition between two brothers", "finding an old photograph in a used book", "a desert at night",
    "a cat that rides the subway", "opening a small bookshop", "a marathon of board games",
    "a garden gnome's adventure",
    "a translator working at a peace conference", "the busiest train station in the world", "a sleepy seaside town",
    "a beekeeper and her apprentice", "a snow day in a big city", "an inventor who builds useless machines",
    "the last day of summer holidays", "a zoo keeper's daily routine", "a hot air balloon ride",
    "a small theatre putting on its first play", "a message found in a library book", "learning a new language abroad",
    "a vineyard during harvest", "a blacksmith in a modern city", "a kid who wants to become an astronaut",
    "a street food stall at midnight", "a river that flows uphill", "a postman on a remote island",
    "growing tomatoes on a balcony", "a chess tournament in a park", "the history of the bicycle",
    "living without the internet for a month", "a dog that can predict the weather", "a birthday on a sailing boat",
    "a secret door in an old house", "working from home with three children", "a traditional tea ceremony",
    "a sculptor who works with ice", "the last bookstore in a big city", "a lost suitcase",
    "a village that celebrates the longest night", "an orchestra rehearsing in an empty hall",
    "a gardener who talks to plants", "a photographer chasing the northern lights", "starting a podcast",
    "a ship's cook on a long voyage", "a small-town radio station", "taking care of a neighbour's parrot",
    "a night market in a coastal city", "an old man who repairs clocks", "a school garden project",
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
    "how a vaccine is tested before it is approved", "how the heart pumps blood", "what an API is",
    "how wind turbines generate power", "why we dream", "how coffee is decaffeinated", "what a mortgage is",
    "how the stock market works", "how airplanes stay in the air", "why the moon has phases", "what DNA does",
    "how a battery stores energy", "how rainbows form", "what a password manager does", "how the internet routes data",
    "how a compost heap works", "why some metals rust", "what a budget deficit is", "how volcanoes erupt",
    "how noise affects health", "what a healthy diet looks like", "how elections are counted",
    "how a camera lens focuses light", "why cats purr", "how glaciers move", "how antibiotics work",
    "what renewable energy is", "how memory works in the brain", "what encryption is", "how a thermostat works",
    "why oceans are salty", "how a loan's interest is calculated", "what machine learning is", "how hurricanes form",
    "how a car engine works", "why exercise improves mood", "how paper is made", "how a search engine ranks pages",
    "what an index fund is", "how birds migrate", "how a dishwasher cleans dishes", "what a food chain is",
    "how the eye sees colour", "how a 3D printer works", "what causes thunder", "how to start saving for retirement",
    "how cheese is made", "what a time zone is", "how sound travels", "how a nuclear reactor works",
    "what a calorie is", "how coral reefs grow", "how a lock and key work", "what causes allergies",
    "how languages change over time", "how a blockchain works", "what the greenhouse effect is",
    "how touchscreens detect fingers", "how to write a good resume", "how the immune system fights a cold",
    "what an operating system does", "how a bicycle stays upright", "how rain is forecast", "what a pension is",
    "how composting reduces waste", "how lightning rods protect buildings", "what probability means",
    "how an elevator works", "why we have leap years", "how a spreadsheet formula works",
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
    "splits a full name into first and last name", "counts how often each character appears in a string",
    "converts a string to title case without changing short words", "finds the second largest number in a list",
    "checks whether a year is a leap year", "converts an integer to binary without built-ins",
    "removes all whitespace from a string", "computes the median of a list", "zips two lists into a dictionary",
    "finds all pairs in a list that sum to a target", "checks whether a number is an Armstrong number",
    "returns the running total of a list", "capitalizes the first letter of every sentence",
    "implements a queue with two stacks", "finds the missing number in a list from 1 to n",
    "truncates a string to n characters and adds an ellipsis", "converts a dictionary to a query string",
    "computes the Levenshtein distance between two strings", "sorts a list of dictionaries by a key",
    "counts the lines, words and characters of a string", "finds the first non-repeating character of a string",
    "shuffles a list with the Fisher-Yates algorithm", "computes the dot product of two vectors",
    "converts snake_case to camelCase", "checks whether a list is sorted", "merges two dictionaries, summing values",
    "implements run-length encoding of a string", "finds the longest word in a sentence",
    "computes compound interest over n years", "validates a password's strength",
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
        ("Write an email inviting a few friends to join you for {s}.", SUBJECTS),
        ("Write a review, as a visitor, of {s}.", SUBJECTS),
        ("Write the first scene of a play about {s}, as a dialogue.", SUBJECTS),
        ("Write a limerick about {s}.", SUBJECTS),
        ("Write a fairy tale for small children about {s}.", SUBJECTS),
        ("Write a blog post introduction about {s}.", SUBJECTS),
        ("Write a postcard message from someone on holiday, mentioning {s}.", SUBJECTS),
        ("Describe {s} in vivid detail, in one paragraph.", SUBJECTS),
    ),
    "chat": (
        ("I'm thinking about {s}. Can you give me some advice?", SUBJECTS),
        ("What would be a fun weekend plan involving {s}?", SUBJECTS),
        ("My friend keeps talking about {s}. What questions could I ask them?", SUBJECTS),
        ("Can you help me make a checklist for {s}?", SUBJECTS),
        ("Tell me something interesting about {t}.", TOPICS),
        ("I never understood {t}. Could you help?", TOPICS),
        ("My daughter asked me about {t} and I didn't know what to say. How would you explain it?", TOPICS),
        ("Quick question: is it true that {t} is hard to understand? Where should I start?", TOPICS),
        ("We disagreed at dinner about {t}. Can you settle it with a clear explanation?", TOPICS),
        ("I want to write a story about {s}. Can you suggest three ideas for the plot?", SUBJECTS),
        ("Give me five names for a blog about {s}.", SUBJECTS),
        ("How do I explain to my parents why I'm excited about {s}?", SUBJECTS),
    ),
    "question": (
        ("Explain {t} in simple terms.", TOPICS), ("Explain {t} to a ten-year-old.", TOPICS),
        ("What are the most common misconceptions about {t}?", TOPICS),
        ("Give a step-by-step explanation of {t}.", TOPICS),
        ("Answer briefly: what should everyone know about {t}?", TOPICS),
        ("What is the history behind {t}?", TOPICS), ("Compare two ways of thinking about {t}.", TOPICS),
        ("Write five quiz questions, with answers, about {t}.", TOPICS),
    ),
    "summary": (
        ("Summarize in five bullet points what a beginner should know about {t}.", TOPICS),
        ("Write a one-paragraph summary of {t} for a school textbook.", TOPICS),
        ("Summarize the pros and cons of {s}.", SUBJECTS),
        ("Give a three-sentence summary of {t} for a busy reader.", TOPICS),
        ("Write a short outline, with headings, of a talk about {t}.", TOPICS),
    ),
    "code": (
        ("Write a Python function that {c}. Include a docstring.", CODE_TASKS),
        ("Write a {l} function that {c}, with a short explanation.", None),
        ("Write unit tests for a Python function that {c}.", CODE_TASKS),
        ("Explain how you would write a function that {c}, then write it in Python.", CODE_TASKS),
        ("Write a command-line Python script that {c}, reading its input from the arguments.", CODE_TASKS),
        ("What edge cases should a function that {c} handle? Then write it in Python.", CODE_TASKS),
    ),
}


# (user, the assistant's answer, the user's follow-up): the follow-up is what the target answers
FOLLOW_UPS = (
    ("Tell me a little about {t}.", "Happy to. Would you like the short version, the history, or how it works?",
     "How it works, please, with one everyday example.", TOPICS),
    ("Can you explain {t}?", "Sure. Is this for yourself, for a class, or to explain it to someone else?",
     "For a presentation to my colleagues tomorrow. Give me the main points and a good opening line.", TOPICS),
    ("I want to write a short story about {s}.", "Nice idea. Should it be funny, sad or mysterious, and how long?",
     "Mysterious, about 150 words. Please write it.", SUBJECTS),
    ("Can you plan a weekend around {s}?", "Of course. Relaxed or busy, and do you have a budget in mind?",
     "Relaxed and cheap. Write the plan for both days.", SUBJECTS),
    ("Write a short poem about {s}.", "Should it rhyme, and is there a mood you want?",
     "No rhyme, and a hopeful mood. Keep it to eight lines.", SUBJECTS),
    ("Write a Python function that {c}.", "Here is a version with a loop. Do you want type hints and tests too?",
     "Yes: add type hints and three unit tests, and show the whole code.", CODE_TASKS),
    ("How would I write a function that {c}?", "Which language are you using, and do you care about speed?",
     "JavaScript, and readability matters more than speed. Show me the code.", CODE_TASKS),
)
# questions about a documentation text (a standard-library docstring), the documentation first
DOC_QUESTIONS = (
    "Summarize this documentation in one sentence.",
    "Explain this to a beginner, with a short usage example.",
    "Which arguments does it take, and what does each one do?",
    "Write a small program that uses this, based only on the documentation.",
    "List the key points of this documentation as bullets.",
    "What mistake would a newcomer be likely to make with this? Answer from the documentation.",
)
DOC_MODULES = (
    "argparse", "base64", "bisect", "calendar", "colorsys", "contextlib", "copy", "csv", "datetime", "decimal",
    "difflib", "enum", "filecmp", "fnmatch", "fractions", "gettext", "glob", "gzip", "hashlib", "html", "ipaddress",
    "itertools", "logging", "math", "mimetypes", "numbers", "operator", "os.path", "pathlib", "platform", "pprint",
    "random", "re", "sched", "secrets", "shlex", "shutil", "statistics", "string", "tarfile", "tempfile", "timeit",
    "traceback", "urllib.parse", "uuid", "wave", "zlib",
)
DOC_CHARS = (120, 300)  # docstrings of this length: the request stays within half a training window


def documentation() -> list[tuple[str, str, bool]]:
    """(name, docstring, held out) of DOC_MODULES' public functions and classes with a docstring of DOC_CHARS
    length; held out where the module's file is (train/data.py's split of the code windows, so no held-out text is
    trained on); modules the built-in prompt sets quote are left out."""
    root = stdlib_root()
    quoted = quoted_stdlib_files()
    out, seen = [], set()
    for module_name in DOC_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # stripped distributions
            continue
        origin = Path(getattr(module, "__file__", None) or module_name).resolve()
        if origin in quoted:
            continue
        held = is_held_out(origin.relative_to(root).as_posix() if origin.is_relative_to(root) else module_name)
        for name in sorted(vars(module)):
            obj = getattr(module, name)
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            if getattr(obj, "__module__", None) != module.__name__:  # imported from elsewhere
                continue
            doc = inspect.getdoc(obj)
            if doc and DOC_CHARS[0] <= len(doc) <= DOC_CHARS[1] and doc not in seen:  # aliases share one
                seen.add(doc)
                out.append((f"{module_name}.{name}", doc, held))
    return out


@functools.cache
def all_requests() -> tuple[Request, ...]:
    """Every request, in a fixed order: the single-turn templates, the follow-ups, the documentation questions
    (built once per process)."""
    out = []
    for kind in TEMPLATES.values():
        for template, fills in kind:
            if fills is None:  # the other languages' code tasks
                out += [templated(template.format(l=lang, c=task)) for lang in LANGUAGES[1:] for task in CODE_TASKS]
            else:
                out += [templated(template.format(**{fill_key(template): f})) for f in fills]
    for *turns, fills in FOLLOW_UPS:
        key = fill_key(turns[0])
        out += [templated(*(t.format(**{key: f}) for t in turns)) for f in fills]
    out += [Request((f"Here is some documentation:\n\n{doc}\n\n{q}",), held)
            for _, doc, held in documentation() for q in DOC_QUESTIONS]
    return tuple(out)


def fill_key(template: str) -> str:
    return "s" if "{s}" in template else "t" if "{t}" in template else "c"


def requests(n: int, held_out: bool, rng: random.Random) -> list[Request]:
    """n requests (repeating the list's shuffled order when n is larger), held-out ones or the others."""
    pool = [r for r in all_requests() if r.held_out == held_out]
    rng.shuffle(pool)
    return [pool[i % len(pool)] for i in range(n)]
