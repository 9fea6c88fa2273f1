"""Capitals and their size (examples/capitals.py)."""
from lmbatch.frontend import gen, select


def instances():          # dicts of program inputs; "id", "gold" and "subject" are kept aside
    return [{"country": "France", "gold": "Paris"}, {"country": "Japan", "gold": "Tokyo"}]

def program(s, country):
    s += f"Q: What is the capital of {country}?\nA:"
    s += select("city", [" Paris", " Tokyo", " Lima"])
    forks = s.fork(2)                       # both branches share the text so far: computed once
    forks[0] += " Its population is" + gen("population", max_tokens=8, stop=".")
    forks[1] += " It is famous for" + gen("famous", max_tokens=12, stop=".")
    forks.join()                            # s["population"] == [text, None], ...
    if "Paris" in s["city"]:                # plain Python control flow on results
        s += " Bonjour!" + gen("greeting", max_tokens=4, temperature=0.7)

    s += " Postcode:" + gen("code", max_tokens=12, regex=r"[0-9]{5}")      # constrained: regex
    s += " Facts:" + gen("facts", max_tokens=64, json_schema={            # or a JSON schema
        "type": "object", "properties": {"river": {"type": "string"}}, "required": ["river"]})

def score(instance, s):                     # optional: metrics per instance, averaged in summary.json
    return {"acc": s["city"].strip() == instance["gold"]}
