"""Template-generated chat prompts for training the drafts, and a held-out evaluation set.

Why templates: no dataset is reachable offline, and the drafts only need to imitate what the
*target* writes for the kinds of requests a chat server sees (explanations, how-tos, lists,
stories, emails, code, arithmetic word problems, summaries, rewriting and copying). The target's
own responses are the labels (training/datagen.py), so the prompts need variety, not quality.

Held-out split: every fill-in value (topic, task, person, paragraph...) is assigned to train or
eval by a stable hash, and an evaluation prompt uses only eval values, so no evaluation prompt
shares its subject with any training prompt (tests/test_training_data.py checks disjointness).
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable

TOPICS = """photosynthesis;black holes;the water cycle;plate tectonics;vaccines;the immune system;inflation;
compound interest;supply and demand;the French Revolution;the Roman Empire;the printing press;the internet;
machine learning;neural networks;blockchain;quantum computing;climate change;renewable energy;nuclear fusion;
electric cars;the stock market;democracy;the moon landing;DNA;evolution;gravity;the speed of light;
volcanoes;earthquakes;hurricanes;the ozone layer;recycling;sleep;meditation;caffeine;vitamins;the human heart;
the brain;memory;language learning;the Renaissance;the Industrial Revolution;World War I;the Cold War;
the Great Wall of China;ancient Egypt;the pyramids;the Olympic Games;jazz music;impressionist painting;
photography;the solar system;Mars;comets;rainbows;tides;magnets;electricity;batteries;solar panels;
wind turbines;airplanes;rockets;satellites;GPS;smartphones;cloud computing;databases;encryption;passwords;
open source software;operating systems;compilers;recursion;sorting algorithms;binary numbers;prime numbers;
probability;statistics;the Pythagorean theorem;fractions;coffee;bread baking;fermentation;chocolate;tea;
honeybees;coral reefs;rainforests;deserts;penguins;whales;dinosaurs;fungi;bacteria;antibiotics;
the placebo effect;exercise;marathon training;yoga;chess;origami;gardening;composting;beekeeping;
time management;public speaking;negotiation;leadership;teamwork;remote work;job interviews;budgeting;
credit scores;taxes;insurance;mortgages;minimalism;urban planning;public transport;bicycles;libraries;
museums;volunteering;social media;video games;film editing;podcasts;the novel;poetry;mythology;
the Silk Road;the Vikings;the Aztecs;the Ottoman Empire;the Moon's phases;auroras;glaciers;rivers""".split(";")

TASKS = """bake a loaf of sourdough bread;start a vegetable garden;learn to play the guitar;write a resume;
prepare for a job interview;save money on groceries;train for a 5k run;improve my sleep;learn a new language;
set up a home Wi-Fi network;back up my computer;change a flat tire;make a budget;organize my closet;
study for an exam;write a cover letter;start a blog;make cold brew coffee;clean a cast iron pan;
plant a tree;care for a houseplant;reduce stress;give a good presentation;make friends in a new city;
learn to cook rice;fix a leaky faucet;paint a room;choose a laptop;plan a road trip;pack for a trip;
teach a dog to sit;start running;write a thank you note;make a smoothie;brew green tea;
keep a journal;speed up a slow computer;learn to swim;make pancakes;host a dinner party;
negotiate a salary;create a strong password;recycle electronics;start meditating;read more books;
improve my handwriting;make homemade pasta;take better photos with a phone;stay focused while studying;
organize a team meeting;write a short story;learn to code;install Python;use git;debug a program""".split(";")

THINGS = """fruits that are high in vitamin C;programming languages;famous scientists;European capitals;
ways to reduce plastic waste;board games for families;healthy breakfast ideas;tips for better sleep;
renewable energy sources;musical instruments;planets in the solar system;benefits of exercise;
common interview questions;features of a good website;ways to save energy at home;hobbies to try;
indoor plants that are easy to care for;classic novels;inventions of the 20th century;
ways to stay productive;dog breeds;vegetables that grow fast;things to pack for camping;
data structures;cloud providers;ways to learn faster;sources of protein;types of clouds;
careers in science;ways to be more creative;historical empires;mammals that live in the ocean;
birds that cannot fly;spices used in Indian cooking;study techniques;team building activities""".split(";")

PEOPLE = """Anna;Ben;Carlos;Diana;Ethan;Fatima;George;Hana;Ivan;Julia;Kenji;Lena;Marco;Nadia;Omar;Priya;
Quinn;Rosa;Sam;Tara;Umar;Vera;Will;Xena;Yusuf;Zoe;Liam;Mia;Noah;Olivia;Pablo;Ruth;Sofia;Tom""".split(";")

ITEMS = """apples;pencils;marbles;books;stickers;cookies;coins;cards;flowers;stamps;oranges;toy cars;
candies;shells;balloons;notebooks;cupcakes;tickets;eggs;bottles""".split(";")

RECIPIENTS = """my manager;a colleague;my landlord;a customer;my professor;the HR department;a new client;
my neighbor;the school principal;a hotel;my team;a supplier;the city council;a friend;my doctor's office;
an old classmate;the IT support team;a job recruiter""".split(";")

MATTERS = """a delayed project deadline;requesting a day off;a broken heater;a refund for a damaged order;
an extension on an assignment;a meeting next week;a price increase;a noisy party;thanking them for their help;
a change in the schedule;an invoice that was paid twice;a lost package;welcoming a new team member;
a reference letter;booking a conference room;a software outage;rescheduling an appointment""".split(";")

CHARACTERS = """a lonely robot;a young dragon;a curious cat;an old lighthouse keeper;a brave knight;
a lost astronaut;a talking tree;a shy baker;a detective in Paris;a girl who can fly;a clever fox;
a retired pirate;a ghost in a library;a time traveler;a little penguin;a street musician;a wizard's apprentice;
a farmer and his horse;a painter who lost her colors;a boy who found a map""".split(";")

EVENTS = """finds a secret door;learns to make friends;saves a village;loses something important;
wins a contest;goes on a long journey;discovers a hidden talent;meets a stranger;gets lost in a storm;
solves a mystery""".split(";")

CODE_TASKS = """reverses a string;checks if a number is prime;computes the factorial of n;finds the largest
element in a list;counts the vowels in a string;merges two sorted lists;removes duplicates from a list;
checks if a string is a palindrome;computes Fibonacci numbers;converts Celsius to Fahrenheit;sorts a list of
dictionaries by a key;reads a CSV file and prints each row;counts word frequencies in a text;flattens a nested
list;validates an email address;computes the average of a list of numbers;finds the second smallest number;
returns the sum of the digits of a number;capitalizes every word in a sentence;generates a random password;
transposes a matrix;finds common elements in two lists;checks if two strings are anagrams;implements binary
search""".split(";")

LANGS = ["Python", "JavaScript", "Java", "C", "Go", "Rust", "SQL", "Bash"]

SENTENCES = """the meeting was moved to thursday because the manager are sick;i has went to the store yesterday
and buyed some milk;their going to the park later if it dont rain;the results of the experiment was very
surprising to everyone;we needs to finish the report before friday;she dont like coffee but she love tea;
the cat chased it's tail for a hour;me and him went to the concert last night;the company have announced new
rules for remote work;there is many reasons to learn a second language;the train arrive at the station at
nine;he could of finished the project earlier;our team are the best in the league;the weather today is more
hotter than yesterday;please send me the files what you mentioned""".split(";")

PARAGRAPHS = [
    "The library in our town opened in 1902 with a gift from a local merchant. For decades it was a single "
    "reading room with a few thousand books. In the 1970s a new wing added a children's section and a small "
    "theater. Today the library lends e-books, runs coding classes for teenagers and hosts a weekly market.",
    "Coffee was first cultivated on the Arabian Peninsula. From there it spread to Persia, Egypt and Turkey, "
    "and coffee houses became places to talk, listen to music and play chess. European travelers brought "
    "coffee home in the seventeenth century, and within a hundred years it was grown across the tropics.",
    "A good night's sleep helps the body repair itself and the brain store memories. Adults need seven to "
    "nine hours. Screens before bed, caffeine in the afternoon and an irregular schedule all make it harder to "
    "fall asleep. A dark, cool room and a fixed wake-up time make it easier.",
    "The project team met on Monday to review the launch plan. Marketing asked for two more weeks to prepare "
    "the campaign, and engineering reported that testing was on schedule. The team agreed to move the launch "
    "to the first week of June and to send customers a preview in May.",
    "Glaciers form where more snow falls in winter than melts in summer. Over many years the snow is pressed "
    "into ice, which slowly flows downhill under its own weight. As glaciers move they carve valleys, carry "
    "rocks over long distances and leave behind lakes when they retreat.",
    "Our bakery starts work at four in the morning. The dough for the bread is mixed the night before and "
    "rests in the fridge. In the morning we shape the loaves, let them rise again and bake them in a stone "
    "oven. By seven the shelves are full and the first customers are at the door.",
    "Electric scooters became popular in many cities within a few years. Supporters say they reduce traffic "
    "and pollution on short trips. Critics point to accidents, scooters left on sidewalks and the short life of "
    "the batteries. Several cities now limit the number of scooters and where they may be parked.",
    "The museum's new exhibition shows tools used by farmers over the last three centuries. Visitors can see "
    "wooden plows, early tractors and a working water pump. A section for children explains how bread gets "
    "from the field to the table, with games and a small garden.",
    "Octopuses are among the most intelligent invertebrates. They can open jars, escape from tanks and use "
    "coconut shells as shelters. Each arm has its own cluster of nerve cells, so an arm can react to touch "
    "and taste even before the brain decides what to do.",
    "The city council voted to build a new bicycle lane along the river. The lane will connect the train "
    "station with the university and will be separated from car traffic by a low wall. Construction starts "
    "in the spring and should take about eight months.",
    "Volunteers cleaned the beach on Saturday morning. In three hours they collected more than two hundred "
    "kilograms of trash, mostly plastic bottles, fishing nets and food wrappers. The organizers plan to repeat "
    "the cleanup every month and to install more trash bins near the parking lot.",
    "Solar panels turn sunlight into electricity using layers of silicon. When light hits the panel, it frees "
    "electrons that flow as a current. Panels work best when they face the sun directly, and their output "
    "drops on cloudy days and in winter, so many homes pair them with batteries.",
]

_Template = tuple[str, str, Callable[[random.Random, Callable[[list[str]], list[str]]], str]]


def _pick(rng: random.Random, pool: list[str]) -> str:
    return rng.choice(pool)


def _templates() -> list[_Template]:
    """(category, name, fill) triples; ``fill(rng, side)`` draws values only from ``side(pool)``."""
    T: list[_Template] = []

    def add(cat: str, name: str, fn: Callable[[random.Random, Callable[[list[str]], list[str]]], str]) -> None:
        T.append((cat, name, fn))

    for fmt in [
        "Explain {} in simple terms.",
        "What is {}?",
        "Why is {} important?",
        "Give me a short overview of {}.",
        "Explain {} to a ten-year-old.",
        "What are the main ideas behind {}?",
        "Tell me three interesting facts about {}.",
        "What are the pros and cons of {}?",
    ]:
        add("explain", fmt, lambda r, s, f=fmt: f.format(_pick(r, s(TOPICS))))
    add("compare", "diff", lambda r, s: "What is the difference between {} and {}?".format(*r.sample(s(TOPICS), 2)))
    for fmt in [
        "How do I {}?",
        "Give me step-by-step instructions to {}.",
        "What are some tips to {}?",
        "I want to {}. Where should I start?",
    ]:
        add("howto", fmt, lambda r, s, f=fmt: f.format(_pick(r, s(TASKS))))
    for fmt in [
        "List {n} {x}.",
        "Name {n} {x} and describe each in one sentence.",
        "Give me a numbered list of {n} {x}.",
    ]:
        add("list", fmt, lambda r, s, f=fmt: f.format(n=r.choice([3, 4, 5, 6, 7]), x=_pick(r, s(THINGS))))
    add("story", "story", lambda r, s: f"Write a short story about {_pick(r, s(CHARACTERS))} who {r.choice(EVENTS)}.")
    add("story", "poem", lambda r, s: f"Write a short poem about {_pick(r, s(TOPICS))}.")
    add(
        "story",
        "dialogue",
        lambda r, s: f"Write a short dialogue between {_pick(r, s(CHARACTERS))} and {_pick(r, s(CHARACTERS))}.",
    )
    add("email", "email", lambda r, s: f"Write an email to {_pick(r, s(RECIPIENTS))} about {_pick(r, s(MATTERS))}.")
    add(
        "email",
        "message",
        lambda r, s: f"Draft a short, polite message to {_pick(r, s(RECIPIENTS))} about {_pick(r, s(MATTERS))}.",
    )
    add("code", "py", lambda r, s: f"Write a Python function that {_pick(r, s(CODE_TASKS))}.")
    add(
        "code",
        "lang",
        lambda r, s: f"Write a {r.choice(LANGS)} function that {_pick(r, s(CODE_TASKS))}, and explain it.",
    )
    add("code", "explain", lambda r, s: f"How would you write code that {_pick(r, s(CODE_TASKS))}? Show an example.")

    def math_add(r: random.Random, s: Callable[[list[str]], list[str]]) -> str:
        n, it = _pick(r, s(PEOPLE)), _pick(r, s(ITEMS))
        a, b = r.randint(3, 60), r.randint(2, 40)
        return f"{n} has {a} {it} and buys {b} more. How many {it} does {n} have now?"

    def math_share(r: random.Random, s: Callable[[list[str]], list[str]]) -> str:
        n, m, it = _pick(r, s(PEOPLE)), _pick(r, s(PEOPLE)), _pick(r, s(ITEMS))
        k = r.randint(2, 8)
        return f"{n} has {k * r.randint(2, 12)} {it} and shares them equally with {m} and {k - 2 if k > 2 else 1} other friends. How many {it} does each person get? Explain your steps."

    def math_price(r: random.Random, s: Callable[[list[str]], list[str]]) -> str:
        n, it = _pick(r, s(PEOPLE)), _pick(r, s(ITEMS))
        return f"{it.capitalize()} cost ${r.randint(1, 9)} each. {n} buys {r.randint(2, 15)} {it} and pays with a ${r.choice([20, 50, 100])} bill. How much change does {n} get?"

    add("math", "add", math_add)
    add("math", "share", math_share)
    add("math", "price", math_price)
    add(
        "math",
        "speed",
        lambda r, s: (
            f"{_pick(r, s(PEOPLE))} drives {r.randint(40, 160)} km in {r.randint(1, 4)} hours. What is the average speed? Show the calculation."
        ),
    )
    add(
        "math",
        "percent",
        lambda r, s: (
            f"{_pick(r, s(PEOPLE))} got {r.choice([5, 10, 15, 20, 25, 30, 40])}% off a bike that cost ${r.randint(20, 900)}. How much was paid? Explain how to compute it."
        ),
    )
    for fmt in [
        "Summarize the following text in two sentences:\n\n{}",
        "Give a one-sentence summary of this text:\n\n{}",
        "What are the key points of this text?\n\n{}",
    ]:
        add("summary", fmt, lambda r, s, f=fmt: f.format(_pick(r, s(PARAGRAPHS))))
    for fmt in [
        "Repeat the following text exactly:\n\n{}",
        "Rewrite the following text in a more formal tone:\n\n{}",
        "Rewrite this text for a child:\n\n{}",
        "Turn this text into a bulleted list:\n\n{}",
    ]:
        add("rewrite", fmt, lambda r, s, f=fmt: f.format(_pick(r, s(PARAGRAPHS))))
    for fmt in [
        "Correct the grammar in this sentence: {}",
        "Rewrite this sentence correctly: {}",
        "Fix the mistakes: {}",
    ]:
        add("rewrite", fmt, lambda r, s, f=fmt: f.format(_pick(r, s(SENTENCES))))
    add(
        "rewrite",
        "json",
        lambda r, s: (
            f"Convert this to a JSON object with fields name, item and count: {_pick(r, s(PEOPLE))} has {r.randint(2, 30)} {_pick(r, s(ITEMS))}."
        ),
    )
    return T


def _is_eval(value: str) -> bool:
    """Stable train/eval assignment of one fill-in value (about 1 in 6 goes to eval)."""
    return int(hashlib.sha1(value.encode()).hexdigest(), 16) % 6 == 0


def _side(eval_side: bool) -> Callable[[list[str]], list[str]]:
    def side(pool: list[str]) -> list[str]:
        values = [v.strip() for v in pool]
        held_out = {v for v in values if _is_eval(v)} or {values[0]}  # a pool the hash left empty gives its first
        return [v for v in values if (v in held_out) == eval_side]

    return side


def make_prompts(n: int, split: str = "train", seed: int = 0) -> list[dict[str, str]]:
    """``n`` distinct prompts ``{"category", "template", "text"}``, cycling over templates."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    rng = random.Random(f"{split}-{seed}")
    side = _side(split == "eval")
    temps = _templates()
    by_cat: dict[str, list[_Template]] = {}
    for t in temps:
        by_cat.setdefault(t[0], []).append(t)
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n and attempts < n * 50:
        attempts += 1
        if split == "eval":  # round-robin over templates: a small, even eval set
            cat, name, fn = temps[attempts % len(temps)]
        else:  # category first, so categories with many templates do not dominate
            cat, name, fn = rng.choice(by_cat[rng.choice(sorted(by_cat))])
        text = fn(rng, side)
        if text in seen:
            continue
        seen.add(text)
        out.append({"category": cat, "template": name, "text": text})
    return out


def eval_prompts(n: int = 24) -> list[str]:
    """The held-out chat prompts the evaluation uses (subjects never seen in training)."""
    return [p["text"] for p in make_prompts(n, "eval", seed=1)]
