"""Benchmark workloads, generated deterministically from a seed (no data set download).

Each workload is a list of chat conversations (OpenAI message lists). One line each:

* code_edit      - rewrite a given function with one small change (output repeats the code).
* rag_quote      - copy, word for word, the sentence of a passage that answers a question.
* json_reformat  - pretty-print a JSON list with one value changed (output repeats the records).
* multi_turn     - turn 2 of a chat asks to repeat turn 1's answer with a change.
* summarisation  - summarise a short report (partial repetition of its phrases).
* translation    - reformat a list of sentences into numbered, quoted lines (translation-style copying).
* creative       - free-form creative text: the no-repetition control.

``hot_sampled`` is the adversarial one: creative prompts answered at a high temperature, where next
to no draft can be accepted.

``long_chats`` joins them into long chat prompts (token ids) of 600-1600 tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

Messages = list[dict[str, str]]
# A conversation sent with sampling settings of its own (``temperature``, ``seed``) instead of greedy.
Sampled = tuple[Messages, dict]

_NAMES = ["alice", "bruno", "chen", "dara", "emeka", "fatima", "goran", "hana", "ivan", "jun", "kofi", "lena"]
_CITIES = ["Lisbon", "Osaka", "Nairobi", "Quito", "Tallinn", "Hanoi", "Perth", "Bergen", "Cusco", "Accra"]
_ITEMS = ["lamp", "kettle", "bicycle", "notebook", "guitar", "backpack", "camera", "blender", "tent", "watch"]
_TOPICS = [
    "a lighthouse keeper",
    "a clockmaker's apprentice",
    "a lost robot",
    "a desert caravan",
    "a city under the sea",
    "a dragon who hates fire",
    "a library that moves",
    "twin astronauts",
]
_SETTINGS = [
    "in a snowed-in mountain village",
    "on the last night of a festival",
    "during a total eclipse",
    "in a city with no clocks",
    "aboard a slow river barge",
    "after the power goes out",
    "on an island that appears once a year",
    "at the bottom of an old well",
]

_FUNCTIONS = [
    (
        "total_price",
        "items",
        "item",
        [
            "    total = 0",
            "    for item in items:",
            "        if item.quantity > 0:",
            "            total += item.price * item.quantity",
            "    return total",
        ],
    ),
    (
        "count_words",
        "text",
        "word",
        [
            "    counts = {}",
            "    for word in text.split():",
            "        word = word.lower().strip('.,!?')",
            "        counts[word] = counts.get(word, 0) + 1",
            "    return counts",
        ],
    ),
    (
        "find_user",
        "users",
        "user",
        [
            "    for user in users:",
            "        if user.email == email and user.active:",
            "            return user",
            "    raise KeyError(email)",
        ],
    ),
    (
        "moving_average",
        "values",
        "value",
        [
            "    window = []",
            "    averages = []",
            "    for value in values:",
            "        window.append(value)",
            "        if len(window) > size:",
            "            window.pop(0)",
            "        averages.append(sum(window) / len(window))",
            "    return averages",
        ],
    ),
]


def code_edit(rng: random.Random) -> Messages:
    name, arg, loop_var, body = rng.choice(_FUNCTIONS)
    extra = {"find_user": ", email", "moving_average": ", size"}.get(name, "")
    new_name = rng.choice(["entry", "element", "record", "thing"])
    code = "\n".join([f"def {name}({arg}{extra}):", *body])
    return [
        {
            "role": "user",
            "content": f"Here is a Python function:\n\n```python\n{code}\n```\n\n"
            f"Rewrite the whole function, renaming the loop variable `{loop_var}` to `{new_name}`. "
            "Output only the code.",
        }
    ]


def rag_quote(rng: random.Random) -> Messages:
    people = rng.sample(_NAMES, 4)
    cities = rng.sample(_CITIES, 4)
    jobs = [
        "a nurse at the central hospital near the river",
        "a teacher at a small school in the old town",
        "a pilot for a regional airline",
        "a chef in a busy harbour restaurant",
        "an engineer at the new water treatment plant",
    ]
    sentences = [
        f"{person.title()} moved to {city} in {rng.randint(1990, 2022)} to work as {rng.choice(jobs)}."
        for person, city in zip(people, cities)
    ]
    passage = " ".join(sentences)
    target = rng.choice(people).title()
    return [
        {
            "role": "user",
            "content": f"{passage}\n\nCopy, word for word, the sentence above that says where "
            f"{target} moved.",
        }
    ]


def json_reformat(rng: random.Random) -> Messages:
    records = [
        {
            "name": name.title(),
            "city": rng.choice(_CITIES),
            "item": rng.choice(_ITEMS),
            "quantity": rng.randint(1, 99),
        }
        for name in rng.sample(_NAMES, 3)
    ]
    listing = json.dumps(records)
    changed = rng.choice(records)["name"]
    return [
        {
            "role": "user",
            "content": f"Here is a JSON list:\n{listing}\n\nRewrite it pretty-printed with an indent of "
            f"2 spaces, and change the quantity of {changed} to {rng.randint(1, 99)}.",
        }
    ]


def multi_turn(rng: random.Random) -> Messages:
    item, city = rng.choice(_ITEMS), rng.choice(_CITIES)
    first_answer = (
        f"Here is a short packing list for a trip to {city}:\n1. A {item}\n2. Comfortable shoes\n"
        f"3. A rain jacket\n4. A water bottle\n5. A map of {city}"
    )
    return [
        {"role": "user", "content": f"Write a short packing list for a trip to {city}."},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "Repeat the same list, but add a phone charger as item 6."},
    ]


def summarisation(rng: random.Random) -> Messages:
    city, item = rng.choice(_CITIES), rng.choice(_ITEMS)
    count = rng.randint(120, 900)
    report = (
        f"The city council of {city} met on Monday to discuss the new public {item} program. "
        f"The program will place {count} shared {item}s in parks and libraries across {city}. "
        f"Residents can borrow a {item} for up to two weeks with a library card. "
        f"The council expects the program to cost less than the current rental scheme, "
        f"and a review of the {item} program is planned after the first year."
    )
    return [{"role": "user", "content": f"Summarise this report in two sentences:\n\n{report}"}]


def translation(rng: random.Random) -> Messages:
    names = rng.sample(_NAMES, 3)
    items = rng.sample(_ITEMS, 3)
    sentences = [
        f"{name.title()} bought a new {item} in {rng.choice(_CITIES)}." for name, item in zip(names, items)
    ]
    listing = "\n".join(sentences)
    return [
        {
            "role": "user",
            "content": "Rewrite each sentence as a numbered line in double quotes, keeping the words "
            f"exactly:\n\n{listing}",
        }
    ]


def creative(rng: random.Random) -> Messages:
    topic, setting = rng.choice(_TOPICS), rng.choice(_SETTINGS)
    return [{"role": "user", "content": f"Write a short, original story about {topic} {setting}."}]


WORKLOADS = {
    "code_edit": code_edit,
    "rag_quote": rag_quote,
    "json_reformat": json_reformat,
    "multi_turn": multi_turn,
    "summarisation": summarisation,
    "translation": translation,
    "creative": creative,
}
REPETITIVE = ("code_edit", "rag_quote", "json_reformat")


def make_workload(name: str, num_prompts: int, seed: int = 0) -> list[Messages]:
    """``num_prompts`` conversations of workload ``name``, the same for the same seed."""
    rng = random.Random(f"{name}:{seed}")
    return [WORKLOADS[name](rng) for _ in range(num_prompts)]


def paraphrase(conversation: Messages) -> Messages:
    """The conversation with its last question reworded (the same request in other words):
    its answer overlaps the original's without equalling it."""
    content = conversation[-1]["content"]
    return [*conversation[:-1], {"role": "user", "content": f"Please help me with this. {content}"}]


# Appended to the last message of earlier conversations once the generators run out of new
# ones (the creative generator makes 64), so a benchmark can still send only new prompts.
_EXTRA_INSTRUCTIONS = (
    "Tell it in the first person.",
    "Keep it under 120 words.",
    "Give it a hopeful ending.",
    "Tell it in the present tense.",
)


def distinct_prompts(names: Sequence[str], num_prompts: int, seed: int = 0) -> list[Messages]:
    """``num_prompts`` pairwise different conversations, taking the workloads ``names`` in turn.

    A server learns every answer it gives (greedy answers to a repeated prompt repeat exactly),
    so a benchmark that sends a prompt twice would measure that memory, not the workload.
    When the generators run out, the rest are the earlier conversations, in order, each with
    one of ``_EXTRA_INSTRUCTIONS`` appended; the first prompts are the same whatever the count.

    Raises:
        ValueError: not even with the extra instructions are there that many.
    """
    rngs = [random.Random(f"{name}:{seed}:distinct") for name in names]
    seen: set[str] = set()
    prompts: list[Messages] = []

    def take(conversation: Messages) -> None:
        key = repr(conversation)
        if key not in seen and len(prompts) < num_prompts:
            seen.add(key)
            prompts.append(conversation)

    for attempt in range(50 * num_prompts):
        if len(prompts) == num_prompts:
            break
        turn = attempt % len(names)
        take(WORKLOADS[names[turn]](rngs[turn]))
    generated = list(prompts)
    for instruction in _EXTRA_INSTRUCTIONS:
        for conversation in generated:
            *history, last = conversation
            take([*history, {**last, "content": f"{last['content']} {instruction}"}])
    if len(prompts) < num_prompts:
        raise ValueError(f"{names} give only {len(prompts)} different conversations, not {num_prompts}")
    return prompts


# Long chats: several workload conversations joined, cut to these prompt lengths in turn.
LONG_CHAT_TOKENS = (600, 1000, 1600)


def long_chats(tokenizer, count: int) -> list[list[int]]:
    """Chat prompts of mixed lengths (``LONG_CHAT_TOKENS`` in turn): earlier conversations of
    every workload as history, a workload's request as the last turn."""
    return [chat_ids(tokenizer, messages) for messages in long_chat_messages(tokenizer, count)]


def long_chat_messages(tokenizer, count: int) -> list[Messages]:
    """The messages of ``long_chats``' prompts."""
    conversations = [conv for name in WORKLOADS for conv in make_workload(name, 8, seed=11)]
    chats = []
    for index in range(count):
        target = LONG_CHAT_TOKENS[index % len(LONG_CHAT_TOKENS)]
        messages: Messages = []
        offset = index
        while True:
            messages.extend(conversations[offset % len(conversations)])
            offset += 7
            if len(chat_ids(tokenizer, messages)) >= target:
                break
        chats.append(messages)
    return chats


def chat_ids(tokenizer, messages: Messages) -> list[int]:
    """The prompt of a chat: its messages on the model's chat template, ready for the answer."""
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


# The adversarial workload's sampling: hot enough that an answer rarely repeats anything, seeded so
# every server samples the same text (verification keeps sampled output exact as well).
HOT_TEMPERATURE = 1.5


def hot_sampled(count: int, seed: int = 0) -> list[Sampled]:
    """``count`` creative conversations, each sampled at ``HOT_TEMPERATURE`` with its own seed."""
    return [
        (messages, {"temperature": HOT_TEMPERATURE, "seed": seed * 1000 + index})
        for index, messages in enumerate(distinct_prompts(["creative"], count, seed=seed + 17))
    ]
