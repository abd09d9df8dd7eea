"""Instructions for distilling a draft from an instruction-tuned target, with no data set to download.

`first_turns(count, seed)` crosses a few hundred topics with request templates (questions, how-tos,
advice, comparisons, writing, code) into single-turn chats. `written_requests(count)` gives requests
written out one by one as users write them (WRITTEN_FILE: longer, more specific and more varied than
any template, on home life, health, money and work, science, history and culture, travel and
hobbies, writing tasks and programming). `follow_ups(chat, answer, rng)` makes
two second-stage chats out of a first answer of the target's own: a follow-up question in the same
conversation, or a summary, rewrite or proofreading request over the answer pasted into the prompt
(where a copying drafter pays). The benchmark's prompt sets (speculative/bench/prompt_sets/) are
written apart from these, so the draft's held-out figures are measured on requests it never saw.

A chat is a list of {"role", "content"} messages, ready for the tokenizer's chat template.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CONCEPTS = """photosynthesis; inflation; the water cycle; machine learning; black holes; compound interest;
the immune system; plate tectonics; democracy; climate change; the internet; vaccines; gravity;
evolution; supply and demand; renewable energy; the stock market; DNA; electricity; the Roman Empire;
the French Revolution; the printing press; blockchain; cloud computing; recursion; encryption;
the greenhouse effect; nuclear fission; the scientific method; opportunity cost; the placebo effect;
the speed of light; antibiotics; volcanoes; earthquakes; the ozone layer; tides; rainbows; sleep;
memory; habits; meditation; nutrition; metabolism; caffeine; the Renaissance; the Industrial Revolution;
the Cold War; the Silk Road; ancient Egypt; the Olympic Games; jazz music; impressionism; poetry;
statistics; probability; algebra; calculus; prime numbers; the Pythagorean theorem; operating systems;
databases; computer networks; version control; unit testing; object-oriented programming; APIs;
sorting algorithms; hash tables; binary search; neural networks; public speaking; leadership; teamwork;
time management; negotiation; budgeting; credit scores; taxes; insurance; remote work; marketing;
customer service; entrepreneurship; recycling; composting; bees; coral reefs; rainforests; deserts;
the Moon; Mars; the Sun; comets; satellites; airplanes; electric cars; bicycles; trains; bridges;
skyscrapers; solar panels; wind turbines; batteries; semiconductors; 3D printing; virtual reality;
social media; video games; chess; soccer; marathons; yoga; coffee; tea; chocolate; bread; cheese;
fermentation; dinosaurs; whales; dogs; cats; birds migrating; the human heart; the brain; vision;
hearing; language learning; writing an essay; critical thinking; philosophy; ethics; happiness;
friendship; climate adaptation; urban planning; public libraries; museums; photography; film making;
the piano; the guitar; painting with watercolors; gardening; houseplants; cooking pasta; baking;
camping; hiking; travel on a budget; first aid; fire safety; earthquakes preparedness""".split(";")

TASKS = """reverses a string; checks whether a number is prime; returns the factorial of n;
computes the nth Fibonacci number; counts the vowels in a string; removes duplicates from a list;
finds the largest element in a list; merges two sorted lists; checks whether a string is a palindrome;
converts Celsius to Fahrenheit; flattens a nested list; counts word frequencies in a text;
returns the second largest number in a list; validates an email address with a regular expression;
reads a CSV file and returns its rows; sorts a list of dictionaries by a key; computes the average of a
list; finds the greatest common divisor of two numbers; checks whether two strings are anagrams;
generates a random password; converts a decimal number to binary; transposes a matrix;
finds all even numbers in a list; capitalizes every word in a sentence; chunks a list into pieces of
size n; computes the sum of the digits of a number; checks whether a year is a leap year;
implements binary search; implements bubble sort; implements a stack class; implements a queue class;
counts the lines in a file; returns the intersection of two lists; rotates a list by k positions;
finds the longest word in a sentence; converts a dictionary to JSON and back; measures how long a
function takes; retries a function call three times; parses a date string; computes compound interest;
finds the missing number in a list from 1 to n; groups words by their first letter""".split(";")

LANGUAGES = ["Python", "JavaScript", "Python", "Python", "Java", "C", "Rust", "Go"]

THINGS = """the ocean; autumn; a lighthouse; a city at night; friendship; a cup of coffee; the first day of
school; a rainy afternoon; a mountain village; an old library; a robot learning to paint; a lost cat;
a dragon who is afraid of fire; a time traveler; a small bakery; the last tree on Earth; a kind stranger;
a summer storm; a chess champion; a spaceship crew; a garden in winter; a music box""".split(";")

PRODUCTS = """a reusable water bottle; noise-cancelling headphones; a standing desk; a smart watch;
a backpack for travel; an electric kettle; a language learning app; a budgeting app; running shoes;
a coffee grinder; a bicycle helmet; a portable charger""".split(";")

RECIPIENTS = """my manager; a colleague; a customer; my landlord; a teacher; a friend; the team;
a job recruiter""".split(";")

SUBJECTS = """a delayed project; asking for a day off; thanking them for their help; a meeting next week;
a late payment; a job application; feedback on a presentation; a broken heater""".split(";")

GOALS = """sleep better; save money; learn to code; stay focused while studying; be more productive;
eat healthier; start running; reduce stress; make new friends; learn a new language; keep a plant alive;
prepare for a job interview; write better emails; improve my memory; drink more water""".split(";")

CONCEPT_TEMPLATES = [
    "What is {x}?",
    "Explain {x} in simple terms.",
    "Why is {x} important?",
    "Give me three interesting facts about {x}.",
    "How would you explain {x} to a ten-year-old?",
    "What are the main ideas behind {x}?",
    "Write a short paragraph about {x}.",
    "What are common misconceptions about {x}?",
    "Tell me about the history of {x}.",
    "How does {x} affect everyday life?",
]
PAIR_TEMPLATES = ["Compare {x} and {y}.", "What is the difference between {x} and {y}?"]
TASK_TEMPLATES = [
    "Write a {lang} function that {x}.",
    "How do I write a program that {x}? Use {lang}.",
    "Write a function in {lang} that {x}, and explain how it works.",
]
OTHER_TEMPLATES = [
    ("Write a short poem about {x}.", THINGS),
    ("Write a short story about {x}.", THINGS),
    ("Describe {x} in a few sentences.", THINGS),
    ("Write a product description for {x}.", PRODUCTS),
    ("How can I {x}?", GOALS),
    ("Give me five tips to {x}.", GOALS),
    ("What is a good plan to {x} in one month?", GOALS),
]

MORE_CONCEPTS = """the human skeleton; muscles; the digestive system; the nervous system; allergies;
viruses; bacteria; the common cold; blood pressure; stretching; posture; dreams; emotions; motivation;
procrastination; creativity; curiosity; empathy; gratitude; kindness; honesty; patience;
the Great Wall of China;
the pyramids; the Vikings; the Aztecs; the Ming dynasty; the American Revolution; World War I;
the space race; the Apollo missions; the International Space Station; telescopes; microscopes;
the periodic table; atoms; molecules; chemical reactions; acids and bases; magnets; sound waves;
light; color; temperature; friction; energy conservation; electric circuits; transistors; lasers;
radio; television; smartphones; the World Wide Web; email; search engines; passwords; cybersecurity;
artificial intelligence; robots; self-driving cars; drones; open source software; spreadsheets;
data visualization; regular expressions; compilers; memory management; multithreading; caching;
linked lists; trees in computer science; graphs; dynamic programming; big O notation; SQL;
JSON; HTTP; web browsers; mobile apps; user experience design; project management; agile
development; code reviews; documentation; interviews; resumes; salaries; retirement savings;
index funds; interest rates; mortgages; renting an apartment; moving to a new city; learning to cook;
meal planning; vegetarian diets; spices; rice; soup; salads; breakfast; desserts; coffee shops;
farmers markets; forests; rivers; oceans; glaciers; weather forecasts; hurricanes; lightning;
snow; seasons; the night sky; constellations; eclipses; planets; stars; galaxies; time zones;
calendars; maps; languages of the world; reading habits; libraries; newspapers; podcasts; music
theory; orchestras; dance; theater; architecture; gardens; parks; zoos; elephants; dolphins;
octopuses; ants; butterflies; horses; penguins; owls; sharks; frogs""".split(";")

MORE_CONCEPT_TEMPLATES = [
    "Can you tell me something surprising about {x}?",
    "What should a beginner know about {x}?",
    "Write three quiz questions about {x}, with answers.",
    "Summarize the key points about {x} in a short list.",
    "How has {x} changed over time?",
    "What are some fun facts about {x} for kids?",
]

MORE_TASKS = """parses a URL into its parts; counts the characters in a string; finds the median of a list;
checks whether a list is sorted; converts a list of strings to uppercase; returns the n largest numbers
in a list; removes whitespace from a string; finds the first repeated character in a string;
computes the area of a circle; converts minutes to hours and minutes; counts how often each letter
appears; reverses the words in a sentence; checks whether a string contains only digits;
merges two dictionaries; finds common elements of three lists; computes the power set of a list;
generates the first n prime numbers; converts a Roman numeral to an integer; formats a number with
commas; shuffles a list; finds the index of the smallest element; splits a text into sentences;
computes a running total of a list; checks whether brackets in a string are balanced;
sorts words by their length; computes the distance between two points; returns the last n lines of
a file; validates a phone number; converts a string to title case; finds the mode of a list""".split(";")

MORE_TASK_TEMPLATES = [
    "Show me how to write a function that {x} in {lang}.",
    "I need a {lang} function that {x}. Can you help?",
]

MORE_OTHER_TEMPLATES = [
    ("Write a haiku about {x}.", THINGS),
    ("Write a limerick about {x}.", THINGS),
    ("Write the opening paragraph of a story about {x}.", THINGS),
    ("List the pros and cons of {x}.", PRODUCTS),
    ("Write a short review of {x}.", PRODUCTS),
    ("What are the first steps to {x}?", GOALS),
    ("What mistakes should I avoid when I try to {x}?", GOALS),
]

FOLLOW_UPS = [
    "Can you give me an example?",
    "Tell me more about that.",
    "Can you explain that more simply?",
    "Why is that?",
    "What should I do next?",
    "Can you make it shorter?",
    "Thanks! Can you summarize that in one sentence?",
]
PASTED = [
    "Summarize the following text in two sentences:\n\n{text}",
    "Rewrite the following text in a more formal tone:\n\n{text}",
    "Fix any grammar mistakes in this text:\n\n{text}",
    "Make this text shorter while keeping its meaning:\n\n{text}",
    "Turn the following text into a bulleted list:\n\n{text}",
    "What is the main point of this text?\n\n{text}",
]


def _items(text_list: list[str]) -> list[str]:
    return [" ".join(item.split()) for item in text_list if item.strip()]


def first_turns(count: int, seed: int = 0) -> list[list[dict]]:
    """`count` distinct single-turn chats (fewer if the templates run out), drawn with `seed`: the
    requests of the first lists (CONCEPTS, TASKS, ... in random order), then those of the MORE_ lists
    (in random order), so that a larger `count` extends a smaller one's chats."""
    rng = random.Random(seed)
    first = _requests(
        _items(CONCEPTS), CONCEPT_TEMPLATES, _items(TASKS), TASK_TEMPLATES, OTHER_TEMPLATES, rng
    )
    for recipient in _items(RECIPIENTS):
        for subject in _items(SUBJECTS):
            first.append(f"Write a short email to {recipient} about {subject}.")
    first = sorted(set(first))
    rng.shuffle(first)
    concepts = _items(CONCEPTS) + _items(MORE_CONCEPTS)
    more = _requests(
        concepts, CONCEPT_TEMPLATES + MORE_CONCEPT_TEMPLATES, _items(TASKS) + _items(MORE_TASKS),
        TASK_TEMPLATES + MORE_TASK_TEMPLATES, OTHER_TEMPLATES + MORE_OTHER_TEMPLATES, rng,
    )  # fmt: skip
    more = sorted(set(more) - set(first))
    rng.shuffle(more)
    return [[{"role": "user", "content": r}] for r in (first + more)[:count]]


def _requests(concepts, concept_templates, tasks, task_templates, others, rng: random.Random) -> list[str]:
    """Every concept in every concept template, as many random pairs of concepts as there are concepts
    in a pair template, every task in every task template (a random language each), every item of each
    (template, items) of `others`."""
    requests = [t.format(x=c) for c in concepts for t in concept_templates]
    for _ in range(len(concepts)):
        x, y = rng.sample(concepts, 2)
        requests.append(rng.choice(PAIR_TEMPLATES).format(x=x, y=y))
    for task in tasks:
        for template in task_templates:
            requests.append(template.format(x=task, lang=rng.choice(LANGUAGES)))
    for template, items in others:
        requests += [template.format(x=x) for x in _items(items)]
    return requests


def follow_ups(chat: list[dict], answer: str, rng: random.Random) -> list[list[dict]]:
    """Two second-stage chats from a first one and the target's answer to it: the conversation with a
    follow-up question, and a request over the answer pasted in (summary, rewrite, proofreading)."""
    turn = [
        *chat,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": rng.choice(FOLLOW_UPS)},
    ]
    pasted = [{"role": "user", "content": rng.choice(PASTED).format(text=answer.strip())}]
    return [turn, pasted]


WRITTEN_FILE = Path(__file__).with_name("written_requests.jsonl")
"""JSON lines {"request": text, "kind": domain}: requests written one by one, one subject each, in the
order written_requests takes them (the domains interleaved)."""


def written_requests(count: int | None = None) -> list[list[dict]]:
    """The first `count` (all where None) of WRITTEN_FILE's requests as single-turn chats; raises
    ValueError where `count` exceeds the file's."""
    lines = WRITTEN_FILE.read_text(encoding="utf-8").splitlines()
    requests = [json.loads(line)["request"] for line in lines if line.strip()]
    if count is not None and count > len(requests):
        raise ValueError(f"count: {count} written requests asked, the file holds {len(requests)}")
    return [[{"role": "user", "content": r}] for r in requests[:count]]
