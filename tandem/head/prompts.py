"""The prompt set for self-distillation of the drafter head: user prompts only; the target model
(SmolLM2-135M-Instruct) writes the responses.

Longer than 300 lines because the subject lists are the data: they are written out here, by hand,
so that the set depends on nothing but this file (no docstrings read from an installed Python).

Rules:
- Every prompt is a template of its family filled with one subject of that family. A family is
  one kind of request (write a function, fix a bug, a shell one-liner, explain a concept, compare
  two things...) with several wordings; each subject gets `per_subject` different wordings, picked
  by `random.Random(subject)`, so a subject's prompts do not move when another subject is added.
- Kinds: "code" (Python, shell, SQL: write, explain, fix, compare) and "chat" (concepts, advice,
  how-to, comparisons, definitions, summaries, short poems and stories, lists), about half each.
- Split by subject: in each family, the 12% of subjects (rounded, at least one) whose SHA-256
  hex digests sort first are "heldout", the rest "train". All prompts of a subject share its
  split, so held-out acceptance measures prompts about subjects the head never trained on; every
  family is in both splits, and adding a subject moves at most one other across. A record's
  "subject" is its items joined by " | "; no subject is in two families.
- None of the benchmark's prompts (bench/) nor a near copy is in the set, nor their subjects
  (Fibonacci, palindromes, a Stack class, merging sorted lists, the code the benchmark edits);
  tests/test_head_prompts.py checks it.
- `prompts.jsonl` beside this file is the committed output of `build()`, one record a line:
  {"id", "kind", "split", "subject", "messages": [{"role": "user", "content"}]}. The id is the
  family and a digest of the content.

CLI: ``python -m tandem.head.prompts --write`` rebuilds the file; without ``--write`` it prints the
counts per split and kind and exits 1 when the file is not what `build()` gives.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections import Counter
from pathlib import Path

PATH = Path(__file__).with_name("prompts.jsonl")
SPLITS = ("train", "heldout")
KINDS = ("code", "chat")
HELDOUT_SHARE = 0.12


def _lines(block: str) -> list[str]:
    return [line.strip() for line in block.strip().splitlines() if line.strip()]


def _paragraphs(block: str) -> list[str]:
    return [" ".join(_lines(p)) for p in block.strip().split("\n\n")]


def _pairs(block: str) -> list[tuple[str, str]]:
    return [tuple(part.strip() for part in line.split("|")) for line in _lines(block)]


# ---- code ----

FUNCTION_TEMPLATES = [
    "Write a Python function that {0}.",
    "Write a Python function that {0}. Include a docstring.",
    "Can you write a short Python function that {0}?",
    "I need a Python function that {0}. Please keep it simple.",
    "Write a Python function that {0}, and show one example call.",
    "Show me how to write a function in Python that {0}.",
]
FUNCTIONS = _lines("""
    reverses the order of the words in a sentence
    counts how many vowels a string contains
    returns the largest of three numbers
    checks whether a number is prime
    returns the factorial of n using recursion
    converts a temperature from Celsius to Fahrenheit
    removes duplicate items from a list while keeping their order
    flattens a list of lists into a single list
    returns the second largest number in a list
    checks whether two strings are anagrams of each other
    counts how often each word appears in a text
    returns the greatest common divisor of two integers
    converts a non-negative integer to its binary representation as a string
    capitalizes the first letter of every word in a sentence
    returns only the even numbers from a list
    sums the digits of a positive integer
    checks whether a year is a leap year
    splits a list into chunks of a given size
    returns the longest word in a sentence
    transposes a matrix given as a list of lists
    rotates a list to the right by k positions
    finds the index of a value in a sorted list using binary search
    sorts a list of dictionaries by a given key
    converts a Roman numeral to an integer
    converts an integer to a Roman numeral
    returns the number of days between two dates given as YYYY-MM-DD strings
    checks whether a string looks like a valid email address
    reads a text file and returns the number of lines in it
    reads a CSV file and returns its rows as a list of dictionaries
    writes a dictionary to a JSON file
    returns the n most common characters in a string
    checks whether a list is sorted in ascending order
    computes the running total of a list of numbers
    returns the items two lists have in common, without duplicates
    generates a random password of a given length
    converts a camelCase string to snake_case
    converts a snake_case string to camelCase
    truncates a string to n characters and adds an ellipsis when it was cut
    computes the dot product of two vectors
    returns the prime factors of an integer
    counts the number of 1 bits in the binary form of an integer
    checks whether the brackets in a string are balanced
    sorts a list with bubble sort
    sorts a list with insertion sort
    sorts a list with quicksort
    returns the median of a list of numbers
    computes the standard deviation of a list of numbers
    scales a list of numbers to the range 0 to 1
    groups a list of words by their first letter
    swaps the keys and values of a dictionary
    combines two dictionaries of counts, adding the values of keys that appear in both
    looks up a value in nested dictionaries by a dotted path like "a.b.c"
    computes the Levenshtein distance between two strings
    removes all punctuation from a string
    returns the first character in a string that does not repeat
    compresses a string with run-length encoding, so "aaabb" becomes "a3b2"
    decodes a run-length encoded string such as "a3b2"
    returns the sum of all numbers in an arbitrarily nested list
    finds all pairs of numbers in a list that add up to a target
    returns the first n rows of Pascal's triangle
    converts a number of seconds into hours, minutes and seconds
    formats a number with commas as thousands separators
    returns the area of a circle given its radius
    computes compound interest for a principal, a yearly rate and a number of years
    computes the body mass index from a weight in kilograms and a height in meters
    checks whether a number is a perfect square
    returns the least common multiple of two integers
    shuffles a list without using random.shuffle
    picks a random item from a list where each item has a weight
    counts the lines, words and characters in a text file
    lists all .txt files in a directory
    returns the file extension of a path
    parses a query string like "a=1&b=2" into a dictionary
    extracts all URLs from a piece of text
    extracts all hashtags from a tweet
    masks all but the last four digits of a credit card number
    checks whether a string is a valid IPv4 address
    converts a hex color like "#ff8800" to an (r, g, b) tuple
    counts the uppercase and the lowercase letters in a string
    calls another function and retries it up to three times if it raises an exception
    measures how long a call of another function takes
    caches the results of a slow function in a dictionary
    yields the lines of a large file one at a time
    yields the square numbers 1, 4, 9, ... one at a time
    finds the one missing number in a list that holds the numbers 1 to n
    detects whether a singly linked list has a cycle
    reverses a singly linked list
    returns the depth of a binary tree
    does a breadth-first search of a graph given as an adjacency dictionary
    finds the shortest path between two nodes of an unweighted graph
    counts the islands in a grid of 0s and 1s
    returns all permutations of a string
    returns all subsets of a list
    builds a dictionary from a list of (key, value) tuples
    pairs up the items of two lists without using zip
    returns the k largest numbers of a list using heapq
    checks whether a filled 9x9 sudoku grid is valid
    plays one round of rock, paper, scissors against the computer
    converts a string to title case but keeps small words like "and" and "of" lowercase
    pads a number with leading zeros to a given width
    removes HTML tags from a string
    counts the weekdays between two dates
    returns today's date in ISO format
    computes the moving mean of a list over a window of k items
    splits a full name into a first name and a last name
    checks whether a sentence uses every letter of the alphabet
    encrypts a text with a Caesar cipher
    turns a list of numbers into a comma-separated string
""")

EXPLAIN_PYTHON_TEMPLATES = [
    "What does this Python code do?\n\n```python\n{0}\n```",
    "Explain this Python code step by step.\n\n```python\n{0}\n```",
    "Explain briefly what the following Python snippet does.\n\n```python\n{0}\n```",
    "Can you walk me through this code?\n\n```python\n{0}\n```",
]
# One snippet a block, blocks separated by a line holding only "---".
EXPLAIN_PYTHON = [s.strip("\n") for s in """
squares = [x * x for x in range(10) if x % 2 == 0]
---
name = user.get("name", "anonymous")
---
with open("data.txt") as f:
    lines = [line.strip() for line in f]
---
counts = {}
for w in words:
    counts[w] = counts.get(w, 0) + 1
---
ranked = sorted(scores.items(), key=lambda kv: kv[1], reverse=True)
---
first, *rest = [1, 2, 3, 4]
---
a, b = b, a
---
line = ", ".join(str(n) for n in numbers)
---
evens = list(filter(lambda n: n % 2 == 0, nums))
---
from collections import Counter
top = Counter(text.split()).most_common(3)
---
for i, item in enumerate(items, start=1):
    print(i, item)
---
grid = [[0] * 3 for _ in range(3)]
---
try:
    value = int(s)
except ValueError:
    value = None
---
def greet(name, greeting="Hello"):
    return f"{greeting}, {name}!"
---
def power(base, exp):
    return 1 if exp == 0 else base * power(base, exp - 1)
---
class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def __repr__(self):
        return f"Point({self.x}, {self.y})"
---
squares = {n: n ** 2 for n in range(1, 6)}
---
def evens():
    n = 0
    while True:
        yield n
        n += 2
---
nums.sort(key=abs)
---
if __name__ == "__main__":
    main()
---
data = json.loads(body)
print(data["items"][0]["id"])
---
strong = len(pw) >= 8 and any(ch.isdigit() for ch in pw)
---
x = [1, 2, 3]
y = x
y.append(4)
---
print("even" if n % 2 == 0 else "odd")
---
numbers = re.findall(r"\\d+", text)
---
@functools.lru_cache(maxsize=None)
def slow_square(n):
    time.sleep(1)
    return n * n
""".split("\n---\n")]

EXPLAIN_SHELL_TEMPLATES = [
    "What does this shell command do?\n\n```bash\n{0}\n```",
    "Explain this command part by part.\n\n```bash\n{0}\n```",
]
EXPLAIN_SHELL = _lines("""
    find . -name "*.log" -mtime +7 -delete
    grep -rn "TODO" src/ | wc -l
    sed -n '10,20p' notes.txt
    ps aux --sort=-%mem | head -5
    ln -s /opt/app/releases/42 /opt/app/current
    df -h /
    sort -t, -k3 -n scores.csv | tail -1
    ls -t | head -n 3
    curl -s https://example.com/api/status | python3 -m json.tool
    export PATH="$HOME/bin:$PATH"
""")

EXPLAIN_SQL_TEMPLATES = [
    "What does this SQL query return?\n\n```sql\n{0}\n```",
    "Explain this SQL query in plain words.\n\n```sql\n{0}\n```",
]
EXPLAIN_SQL = _lines("""
    SELECT department, COUNT(*) FROM employees GROUP BY department HAVING COUNT(*) > 5;
    SELECT name FROM products WHERE price > (SELECT AVG(price) FROM products);
    SELECT author_id, MAX(published_on) FROM posts GROUP BY author_id;
    SELECT COALESCE(nickname, name) AS display_name FROM users;
    UPDATE accounts SET balance = balance - 50 WHERE id = 7;
    SELECT * FROM events WHERE starts_at BETWEEN '2024-01-01' AND '2024-01-31';
""")

BUG_TEMPLATES = [
    "This code should {0}, but it has a bug. Find the bug and fix it.\n\n```python\n{1}\n```",
    "Fix the bug in this Python code. It is supposed to {0}.\n\n```python\n{1}\n```",
    "Why doesn't this code {0} correctly?\n\n```python\n{1}\n```",
]
# (what the code should do, the buggy code)
BUGS = [
    ("return the largest number in a list",
     "def largest(nums):\n    best = 0\n    for n in nums:\n        if n > best:\n            best = n\n"
     "    return best"),
    ("return the sum of the numbers 1 to n",
     "def sum_to(n):\n    s = 0\n    for i in range(n):\n        s += i\n    return s"),
    ("return the last item of a list", "def last(items):\n    return items[len(items)]"),
    ("return a new list holding just the given item on each call",
     "def wrap(item, items=[]):\n    items.append(item)\n    return items"),
    ("check whether a number is even", "def is_even(n):\n    return n % 2 == 1"),
    ("count down from n to 1", "def countdown(n):\n    while n > 0:\n        print(n)"),
    ("reverse a string", "def reverse(s):\n    return s[::1]"),
    ("map each word to its length",
     "def lengths(words):\n    result = {}\n    for w in words:\n        result[w] = len(words)\n    return result"),
    ("read a number from the user and print it doubled", 'n = input("Number: ")\nprint(n * 2)'),
    ("remove the negative numbers from a list",
     "def drop_negatives(nums):\n    for n in nums:\n        if n < 0:\n            nums.remove(n)\n    return nums"),
    ("print True because 0.1 + 0.2 equals 0.3", "print(0.1 + 0.2 == 0.3)"),
    ("greet a user by name", 'def greet(name):\n    print("Hello, " + name + "!"'),
    ("return the product of a list of numbers",
     "def product(nums):\n    result = 0\n    for n in nums:\n        result *= n\n    return result"),
    ("build the squares of the numbers 1 to 5",
     "squares = []\nfor i in range(1, 5):\n    squares.append(i ** 2)"),
    ("change a copy of a list without changing the original",
     "original = [1, 2, 3]\ncopy = original\ncopy.append(4)\nprint(original)"),
    ("print each character of a word with its index", 'word = "hello"\nfor i in len(word):\n    print(i, word[i])'),
    ("print the age plus one", 'age = "41"\nprint(age + 1)'),
    ("check whether a key is in a dictionary", 'if config.has_key("debug"):\n    print("debug mode")'),
    ("return the middle item of a list", "def middle(xs):\n    return xs[len(xs) / 2]"),
    ("make a 3x3 grid of zeros and set only its top-left cell to 1",
     "grid = [[0] * 3] * 3\ngrid[0][0] = 1\nprint(grid)"),
    ("sort a list of names and print it", 'names = ["bob", "alice"]\nnames = names.sort()\nprint(names)'),
    ("compute the area of a rectangle",
     "class Rectangle:\n    def __init__(self, w, h):\n        self.w = w\n        self.h = h\n\n"
     "    def area():\n        return self.w * self.h"),
    ("print each line of a file without surrounding whitespace",
     'with open("notes.txt") as f:\n    for line in f:\n        line.strip()\n        print(line)'),
    ("return True if any number in the list is negative",
     "def has_negative(nums):\n    for n in nums:\n        if n < 0:\n            return True\n"
     "        else:\n            return False"),
    ("join a list of numbers into one string", 'nums = [1, 2, 3]\nprint(", ".join(nums))'),
    ("add one to a global counter", "calls = 0\n\ndef bump():\n    calls += 1"),
    ("stop asking once the user types quit",
     'while True:\n    answer = input("> ")\n    if answer == "quit":\n        continue\n    print(answer)'),
    ("return a list of the words in a sentence, lowercased",
     "def words(sentence):\n    for w in sentence.split():\n        return w.lower()"),
]

SHELL_TEMPLATES = [
    "Write a shell command that {0}.",
    "What Linux command {0}?",
    "Give me a one-line bash command that {0}, and explain it briefly.",
    "How can I write a bash one-liner that {0}?",
]
SHELL = _lines("""
    lists all files in the current directory, including hidden ones
    shows the ten largest files under a directory
    counts the lines of every .py file in a project
    finds all files modified in the last 24 hours
    deletes all .tmp files under the current directory
    searches all log files for the word "error", ignoring case
    replaces "foo" with "bar" in a file in place
    shows how much disk space each folder in the current directory uses
    shows which process is listening on port 8080
    stops every process with a given name
    creates a compressed archive of a folder
    extracts a .tar.gz archive into a given directory
    downloads a file from a URL with curl
    prints the last 50 lines of a log file and keeps following it
    renames all .jpeg files in a folder to .jpg
    counts the unique IP addresses in a web server access log
    sorts the lines of a file and removes duplicates
    shows how much free memory a Linux machine has
    makes a script executable
    copies a directory to a remote server with rsync
    prints the third column of a CSV file
    shows the git commits of the last week
    creates a new git branch and switches to it
    undoes the last git commit but keeps the changes
    shows the environment variables whose name contains PATH
    runs a command every 5 seconds and shows its output
    shows the five commands used most often in my shell history
    checks whether a website answers with HTTP status 200
    creates ten empty files named file1.txt to file10.txt
    shows the size of a file in a human-readable form
    counts how many files are in a directory
    finds broken symbolic links in a directory
    changes the owner of a folder and everything in it
    prints the current date as YYYY-MM-DD
    converts a file's line endings from Windows to Unix
    saves the installed Python packages to requirements.txt
""")

SQL_TEMPLATES = [
    "Write an SQL query that {0}.",
    "How do I write a SQL query that {0}?",
    "Using SQL, write a query that {0}.",
]
SQL = _lines("""
    selects the users who signed up in 2023 from a table users(id, name, created_at)
    returns the five most expensive products from products(id, name, price)
    counts the orders of each customer in orders(id, customer_id, amount)
    finds customers who never placed an order, given customers(id, name) and orders(id, customer_id)
    returns the second highest salary from employees(id, name, salary)
    lists each department with its mean salary, from employees(id, name, department, salary)
    finds duplicate email addresses in users(id, email)
    deletes the sessions older than 30 days from sessions(id, user_id, created_at)
    raises the price of every product in the category 'books' by 10 percent, in products(id, category, price)
    shows each order with the customer's name, given orders(id, customer_id, amount) and customers(id, name)
    returns the sales per month from sales(id, amount, sold_at)
    finds the employees who earn more than their manager, in employees(id, name, salary, manager_id)
    creates a table for blog posts with an id, a title, a body and a creation time
    adds an index on the email column of a users table
    returns the number of distinct cities in customers(id, name, city)
    lists the three students with the best mean grade, from grades(student_id, course, grade)
    finds the products whose name contains 'pro', in products(id, name)
    returns the latest order of each customer, from orders(id, customer_id, created_at)
    computes a running sum of payments ordered by date, in payments(id, amount, paid_on)
    finds the books without an author, in books(id, title, author_id)
    lists the movies released between 2000 and 2010 by rating, from movies(id, title, year, rating)
    counts the users who logged in on each of the last seven days, from logins(user_id, logged_in_at)
    inserts three rows into a table colors(id, name)
    returns the share of orders that were cancelled, from orders(id, status)
    finds the month with the highest revenue, from invoices(id, amount, issued_on)
    ranks the employees of each department by salary with a window function, in employees(id, department, salary)
    deletes the rows with no email from contacts(id, name, email)
    lists the pairs of users who live in the same city, from users(id, name, city)
""")

CODE_CONCEPT_TEMPLATES = [
    "Can you explain {0} with a small example?",
    "Explain {0} to a beginner programmer.",
    "What should a beginner know about {0}? Include a short example.",
]
CODE_CONCEPTS = _lines("""
    list comprehensions in Python
    decorators in Python
    generators in Python
    the with statement in Python
    *args and **kwargs in Python
    lambda functions
    exceptions and try/except in Python
    virtual environments in Python
    recursion
    Big-O notation
    the global interpreter lock in Python
    mutable default arguments in Python
    type conversion in Python
    classes and objects
    inheritance in object-oriented programming
    unit testing with pytest
    async and await in Python
    the __init__ method of a Python class
    slicing in Python
    iterators in Python
    closures
    dataclasses in Python
    the global keyword in Python
    modules and imports in Python
    garbage collection
    REST APIs
    regular expressions
    hash tables
    Docker containers
    environment variables
    dynamic programming
    SQL indexes
    the JSON format
    the event loop in asyncio
""")

CODE_COMPARE_TEMPLATES = [
    "What is the difference between {0} and {1}?",
    "When should I use {0} and when {1}?",
    "Compare {0} and {1} briefly, with an example.",
]
CODE_COMPARE = _pairs("""
    a list | a tuple in Python
    `==` | `is` in Python
    `append` | `extend` on a Python list
    a shallow copy | a deep copy
    a process | a thread
    TCP | UDP
    `git fetch` | `git pull`
    WHERE | HAVING in SQL
    an inner join | a left join
    `let` | `const` in JavaScript
    a compiled language | an interpreted language
    `@staticmethod` | `@classmethod`
    `list.sort()` | `sorted()`
    `break` | `continue`
    an array | a linked list
    an HTTP GET request | an HTTP POST request
    pip | conda
    unit tests | integration tests
    `json.load` | `json.loads`
    a set | a dictionary in Python
    `__str__` | `__repr__`
    SQL databases | NoSQL databases
    a `for` loop | a `while` loop
    a breadth-first search | a depth-first search
""")

# ---- chat ----

CONCEPT_TEMPLATES = [
    "Explain {0} in simple terms.",
    "Can you explain {0} to a ten-year-old?",
    "Give me a short explanation of {0}.",
    "I never really understood {0}. Can you explain it briefly?",
    "Explain {0} in three sentences.",
]
CONCEPTS = _lines("""
    photosynthesis
    inflation
    how vaccines work
    the water cycle
    gravity
    black holes
    the greenhouse effect
    supply and demand
    machine learning
    the immune system
    plate tectonics
    the stock market
    DNA
    evolution by natural selection
    the theory of relativity
    how electricity flows in a circuit
    how the internet works
    encryption
    the placebo effect
    opportunity cost
    the scientific method
    cognitive dissonance
    the Pythagorean theorem
    probability
    interest rates
    nuclear fission
    why we have tides
    why we have seasons
    how rainbows form
    the fall of the Roman Empire
    the French Revolution
    the Industrial Revolution
    the Renaissance
    antibiotic resistance
    the food chain
    osmosis
    the speed of light
    how volcanoes erupt
    what causes earthquakes
    the phases of the Moon
    a recession
    credit scores
    the carbon cycle
    metabolism
    how muscles grow
    how the eye sees colour
    neural networks
    quantum computing
    the Big Bang
    how airplanes stay in the air
    how batteries store energy
    how solar panels make electricity
    the printing press
    prime numbers
    how the heart pumps blood
    hibernation
    the Cold War
    how a compass works
    why the sky is blue
    how birds migrate
""")

ADVICE_TEMPLATES = [
    "How can I {0}?",
    "Give me three tips to {0}.",
    "What are some practical ways to {0}?",
    "I want to {0}. Any advice?",
]
ADVICE = _lines("""
    sleep better
    stay focused while working from home
    prepare for a job interview
    save money on groceries
    start running as a beginner
    learn a new language as an adult
    make friends in a new city
    stay calm before an exam
    keep my houseplants alive
    be more productive in the morning
    give a good presentation
    write a strong cover letter
    ask for a raise
    stop procrastinating
    eat more vegetables
    organize a small apartment
    plan a monthly budget
    deal with a difficult coworker
    improve my handwriting
    remember people's names
    get better at chess
    drink more water during the day
    spend less time looking at screens
    get through a long flight comfortably
    keep a journal every day
    start a small vegetable garden
    take better photos with my phone
    ask for feedback at work
    teach a puppy to sit
    motivate myself to exercise
    read more books
    pack light for a week-long trip
    make a good first impression
    handle criticism calmly
    study for a math test
    keep my desk tidy
    spend less time on social media
    choose my first programming language
    get back into a routine after a holiday
    become a better listener
""")

COMPARE_TEMPLATES = [
    "What is the difference between {0} and {1}?",
    "Compare {0} and {1} in a short paragraph.",
    "How is {0} different from {1}?",
]
COMPARE = _pairs("""
    a virus | a bacterium
    weather | climate
    a crocodile | an alligator
    butter | margarine
    renting a home | buying a home
    stocks | bonds
    a debit card | a credit card
    tea | coffee
    a lake | a pond
    a hurricane | a tornado
    an ocean | a sea
    speed | velocity
    weight | mass
    a democracy | a republic
    an introvert | an extrovert
    baking soda | baking powder
    a simile | a metaphor
    a violin | a viola
    empathy | sympathy
    a comet | an asteroid
    a frog | a toad
    e-books | paper books
    electric cars | petrol cars
    jam | jelly
    a rabbit | a hare
    "affect" | "effect"
    a dolphin | a shark
    a savings account | a current account
    an herb | a spice
    mitosis | meiosis
    a city | a town
    a cold | the flu
    a lawyer | a notary
    a museum | a gallery
""")

HOWTO_TEMPLATES = [
    "How do I {0}? Give step-by-step instructions.",
    "Explain briefly how to {0}.",
    "What are the steps to {0}?",
    "Can you tell me how to {0}?",
]
HOWTO = _lines("""
    boil an egg
    tie a tie
    fix a flat bicycle tire
    make pour-over coffee
    write a thank-you note
    plant a tree
    clean a cast-iron pan
    fold a fitted sheet
    make pancakes from scratch
    iron a shirt
    set up a home Wi-Fi network
    back up the photos on my phone
    fold a paper airplane
    wash a wool sweater
    jump-start a car
    cook rice on the stove
    sew on a button
    get a coffee stain out of a shirt
    brew green tea
    start a campfire safely
    hang a picture frame straight
    unclog a sink without chemicals
    make a fruit smoothie
    juggle three balls
    do a proper push-up
    pack a suitcase efficiently
    replace a light bulb safely
    plan a birthday party
    read a nutrition label
    bake bread at home
    descale a kettle
    meditate for five minutes
    whistle with my fingers
    polish leather shoes
    defrost a freezer
""")

DEFINITION_TEMPLATES = [
    'What does the word "{0}" mean?',
    'Define "{0}" and use it in a sentence.',
    'What is the meaning of "{0}"? Give an example sentence.',
    'Explain the word "{0}" in plain English.',
]
DEFINITIONS = """
    ephemeral ubiquitous serendipity pragmatic nostalgia ambiguous resilient meticulous
    procrastination euphemism paradox irony altruism candid frugal verbose tenacious eloquent
    benevolent cynical diligent hypothesis zeitgeist schadenfreude wanderlust hubris catharsis
    epiphany juxtaposition dichotomy anecdote ambivalent mundane quintessential gregarious
    lethargic nuance enigma sarcasm jargon cliché oxymoron idiom inertia entropy
""".split()

SUMMARY_TEMPLATES = [
    "Summarize this in one sentence:\n\n{0}",
    "Give a short summary of the following text.\n\n{0}",
    "What is the main point of this paragraph?\n\n{0}",
    "Summarize the text below in two bullet points.\n\n{0}",
]
# One paragraph a subject, paragraphs separated by a blank line.
SUMMARIES = _paragraphs("""
    The city council voted on Tuesday to turn the old railway depot into a public library.
    Construction will start next spring and is expected to take two years. The project is paid for
    partly by a national grant and partly by local taxes, and the council says the library will have
    a children's reading room and a small café.

    Honeybees tell each other where flowers are through a movement called the waggle dance. The
    angle of the dance relative to the sun gives the direction, and the length of the waggle gives
    the distance. Scientists decoded this behaviour in the 1940s, and it is still one of the best-
    known examples of animal communication.

    Our team tried a four-day work week for six months. Output stayed roughly the same, sick days
    dropped by a third, and most people said they felt less tired. Some customers complained about
    slower replies on Fridays, so a small rotating crew now stays online that day.

    Maple syrup is made from sap collected from maple trees in early spring, when cold nights and
    warm days make the sap flow. The sap is mostly water, so it is boiled for hours until it
    thickens. It takes about forty litres of sap to make one litre of syrup.

    The museum's new exhibition shows everyday objects from ancient Egypt: combs, sandals, board
    games and bread moulds. Instead of pharaohs and tombs, it shows how ordinary people lived,
    worked and played more than three thousand years ago.

    Researchers followed two thousand adults for ten years and found that people who walked at least
    seven thousand steps a day had a lower risk of heart disease than those who walked less. Walking
    faster added little once the number of steps was taken into account.

    The app update changes how notifications work. Instead of an alert for every message, it now
    sends one summary an hour, unless the message comes from a contact marked as a favourite. Users
    can switch back to the old behaviour in the settings.

    Sourdough bread rises because of wild yeast and bacteria living in a starter, a mix of flour and
    water that is fed regularly. The bacteria make acids that give the bread its sour taste, while
    the yeast makes the gas that lifts the dough. A well-kept starter can live for decades.

    Last weekend's storm brought down trees across the north of the region and left about twelve
    thousand homes without power. Most were reconnected within a day. The weather service warned
    that more strong wind could arrive on Thursday.

    Octopuses have three hearts and blue blood. Two hearts pump blood through the gills, and the
    third pumps it through the rest of the body. Their blood is blue because it carries oxygen with
    a copper-based molecule instead of an iron-based one.

    The company will stop selling its oldest laptop model at the end of the year. Owners will still
    get security updates for three more years. Schools, the largest buyers of that model, are
    advised to plan replacements over their next two budgets.

    Learning an instrument as an adult is slower than as a child, but adults have advantages: they
    practise deliberately, pick up music theory faster and choose the music they enjoy. Teachers say
    the biggest obstacle is usually finding regular time to practise, not talent.

    The Great Wall of China is not one wall but a series of walls and forts built over many
    centuries by different dynasties. Much of what visitors see today was built under the Ming.
    Despite a popular myth, it cannot be seen from the Moon with the naked eye.

    In the meeting we agreed to move the product launch from March to May. The two extra months will
    go to fixing the remaining payment bugs and translating the interface into Spanish and German.
    Marketing will send a new timeline by next Friday.

    Sleep helps the brain keep memories. During deep sleep, what was learned during the day is
    replayed and moved into long-term memory. Students who sleep well after studying tend to
    remember more than those who stay up late going over the same material.

    Tomatoes were once thought poisonous in parts of Europe, partly because they belong to the same
    plant family as deadly nightshade. Only in the eighteenth century did they become a common food
    there. Today they are among the most widely grown vegetables in the world, although botanists
    call them fruits.

    The neighbourhood centre now lends more than books: residents can borrow tools, board games,
    sewing machines and even a telescope. The idea is to save people money and cut waste, since many
    of these things are used only a few times a year.

    Glaciers form where more snow falls in winter than melts in summer. Over the years the snow is
    pressed into ice, which slowly flows downhill under its own weight. Many glaciers are now
    shrinking because warmer summers melt the ice faster than new snow replaces it.
""")

CREATIVE_TEMPLATES = [
    "Write a short poem about {0}.",
    "Write a haiku about {0}.",
    "Write a four-line poem about {0}.",
    "Write a very short story, under 100 words, about {0}.",
]
CREATIVE = _lines("""
    a rainy Monday morning
    the first snow of winter
    an old lighthouse
    a cat watching birds from a window
    a city at night
    a forgotten umbrella
    the smell of fresh bread
    a long train journey
    autumn leaves
    a robot learning to paint
    a lost sock
    the last day of summer
    a quiet library
    a thunderstorm
    a grandmother's garden
    a friendly dragon
    the moon over the sea
    a busy restaurant kitchen
    the first cup of coffee
    a paper boat on a puddle
    a mountain lake
    a dog waiting at the door
    a starry desert sky
    a broken clock
    a child's first bicycle ride
    a Saturday market
    fog in the valley
    a letter that was never sent
""")

LIST_TEMPLATES = [
    "List five {0}.",
    "Name a few {0}.",
    "What are some {0}?",
    "Give me a short list of {0}.",
]
LISTS = _lines("""
    fruits that are high in vitamin C
    indoor hobbies for a rainy day
    board games for a family evening
    questions to ask a landlord before renting a flat
    healthy snacks to take to work
    countries in South America and their capitals
    ways to reuse glass jars
    famous scientists and what they discovered
    animals that live in the Arctic
    things to pack for a weekend camping trip
    classic novels worth reading
    ways to save electricity at home
    birds that are common in European gardens
    exercises that need no equipment
    dinners that take less than 20 minutes to cook
    planets of the solar system, with one fact about each
    instruments in a symphony orchestra
    good study habits for students
    things to check before a long car trip
    kinds of clouds and how to recognize them
    common English idioms and their meanings
    ways to say thank you in other languages
    inventions that changed everyday life
    herbs that grow well on a windowsill
    ideas for a picnic menu
    warning signs of burnout
""")

# (family, kind, wordings per subject, templates, subjects)
FAMILIES = [
    ("function", "code", 2, FUNCTION_TEMPLATES, FUNCTIONS),
    ("explain-python", "code", 2, EXPLAIN_PYTHON_TEMPLATES, EXPLAIN_PYTHON),
    ("explain-shell", "code", 1, EXPLAIN_SHELL_TEMPLATES, EXPLAIN_SHELL),
    ("explain-sql", "code", 1, EXPLAIN_SQL_TEMPLATES, EXPLAIN_SQL),
    ("bug", "code", 2, BUG_TEMPLATES, BUGS),
    ("shell", "code", 1, SHELL_TEMPLATES, SHELL),
    ("sql", "code", 1, SQL_TEMPLATES, SQL),
    ("code-concept", "code", 1, CODE_CONCEPT_TEMPLATES, CODE_CONCEPTS),
    ("code-compare", "code", 1, CODE_COMPARE_TEMPLATES, CODE_COMPARE),
    ("concept", "chat", 2, CONCEPT_TEMPLATES, CONCEPTS),
    ("advice", "chat", 2, ADVICE_TEMPLATES, ADVICE),
    ("compare", "chat", 2, COMPARE_TEMPLATES, COMPARE),
    ("howto", "chat", 2, HOWTO_TEMPLATES, HOWTO),
    ("definition", "chat", 1, DEFINITION_TEMPLATES, DEFINITIONS),
    ("summary", "chat", 2, SUMMARY_TEMPLATES, SUMMARIES),
    ("creative", "chat", 1, CREATIVE_TEMPLATES, CREATIVE),
    ("list", "chat", 1, LIST_TEMPLATES, LISTS),
]


def heldout(subjects: list[str]) -> set[str]:
    """The HELDOUT_SHARE of `subjects` (at least one) whose SHA-256 hex digests sort first."""
    ranked = sorted(subjects, key=lambda s: hashlib.sha256(s.encode()).hexdigest())
    return set(ranked[:max(1, round(len(subjects) * HELDOUT_SHARE))])


def build() -> list[dict]:
    """Every family's subjects, each in `per_subject` of the family's wordings, in list order."""
    records = []
    for family, kind, per_subject, templates, subjects in FAMILIES:
        items = [(s,) if isinstance(s, str) else tuple(s) for s in subjects]
        held = heldout([" | ".join(item) for item in items])
        for item in items:
            subject = " | ".join(item)
            for template in random.Random(subject).sample(templates, per_subject):
                content = template.format(*item)
                digest = hashlib.sha256(content.encode()).hexdigest()[:10]
                records.append({"id": f"{family}-{digest}", "kind": kind,
                                "split": "heldout" if subject in held else "train",
                                "subject": subject, "messages": [{"role": "user", "content": content}]})
    return records


def dumps(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def load(split: str | None = None, kind: str | None = None) -> list[dict]:
    """The committed records, those of `split` and `kind` where given."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: one of {', '.join(SPLITS)}")
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    records = [json.loads(line) for line in PATH.read_text(encoding="utf-8").splitlines()]
    return [r for r in records if split in (None, r["split"]) and kind in (None, r["kind"])]


def stratified(records: list[dict], n: int, skip: int = 0) -> list[dict]:
    """n records taken in turn from each family (a record's id less its digest), after the first
    `skip` so taken: held-out sets that cover every family alike (the trainer evaluates on the first
    ones and fits its calibration on the next, the benchmark serves the first ones)."""
    families: dict[str, list[dict]] = {}
    for r in records:
        families.setdefault(r["id"].rsplit("-", 1)[0], []).append(r)
    order = [r for i in range(max(map(len, families.values()), default=0))
             for group in families.values() if i < len(group) for r in group[i:i + 1]]
    return order[skip:skip + n]


def is_current(path: Path = PATH) -> bool:
    """Whether `path` holds exactly what `build()` gives."""
    return path.exists() and path.read_text(encoding="utf-8") == dumps(build())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.head.prompts", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help=f"rebuild {PATH.name}")
    a = p.parse_args(argv)
    records = build()
    if a.write:
        PATH.write_text(dumps(records), encoding="utf-8")
    counts = Counter((r["split"], r["kind"]) for r in records)
    for split in SPLITS:
        print(f"{split:8} " + "  ".join(f"{kind} {counts[split, kind]:4}" for kind in KINDS)
              + f"  total {sum(counts[split, kind] for kind in KINDS):4}")
    print(f"{'all':8} " + "  ".join(f"{kind} {sum(counts[s, kind] for s in SPLITS):4}" for kind in KINDS)
          + f"  total {len(records):4}")
    if not is_current():
        print(f"{PATH} is not what build() gives: run python -m tandem.head.prompts --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
