"""The built-in synthetic language pair: a toy translation task that needs
real translation, generated from a seed (no download).

Source ("en"): subject-verb-object, e.g. `the big blorp sees a trin with the dask`.
Target ("de"): subject-object-verb with German-like agreement:
- every word has its own translation (a few hundred content words, target
  words spelled with ä, ö, ü, ß so that UTF-8 matters);
- nouns have a gender; articles agree with the noun's gender, number,
  definiteness and case (nominative subject, accusative object, dative after
  prepositions); adjectives agree with the noun's gender and number;
- the verb agrees with the subject's number and moves to the end of its clause;
- plural nouns take `-s` in the source and `-en` in the target; two clauses
  may be joined with `and` / `und`. Sentences have 3 to 25 words.
"""

import numpy as np

SOURCE_SYLLABLES = ["bl", "tr", "sk", "m", "p", "d", "g", "fl", "n", "r", "st", "k"]
SOURCE_VOWELS = ["a", "e", "i", "o", "u", "oo", "ai"]
TARGET_SYLLABLES = ["sch", "kr", "w", "z", "h", "br", "pf", "l", "gr", "d", "ß", "t"]
TARGET_VOWELS = ["ä", "ö", "ü", "a", "ei", "au", "ie"]
GENDERS = ("m", "f", "n")
# Articles by (definite, gender or "pl", case).
ARTICLES = {
    (True, "m", "nom"): "der",
    (True, "f", "nom"): "die",
    (True, "n", "nom"): "das",
    (True, "m", "acc"): "den",
    (True, "f", "acc"): "die",
    (True, "n", "acc"): "das",
    (True, "m", "dat"): "dem",
    (True, "f", "dat"): "der",
    (True, "n", "dat"): "dem",
    (True, "pl", "nom"): "die",
    (True, "pl", "acc"): "die",
    (True, "pl", "dat"): "den",
    (False, "m", "nom"): "ein",
    (False, "f", "nom"): "eine",
    (False, "n", "nom"): "ein",
    (False, "m", "acc"): "einen",
    (False, "f", "acc"): "eine",
    (False, "n", "acc"): "ein",
    (False, "m", "dat"): "einem",
    (False, "f", "dat"): "einer",
    (False, "n", "dat"): "einem",
}
ADJECTIVE_ENDINGS = {"m": "er", "f": "e", "n": "es", "pl": "en"}
PREPOSITIONS = {
    "with": "mit",
    "near": "bei",
    "from": "von",
    "after": "nach",
    "under": "unter",
    "behind": "hinter",
    "beside": "neben",
    "before": "vor",
}


def _words(rng, count, syllables, vowels, taken):
    words = []
    while len(words) < count:
        word = "".join(rng.choice(syllables) + rng.choice(vowels) for _ in range(rng.integers(1, 3)))
        word += rng.choice(syllables) if rng.random() < 0.6 else ""
        if word not in taken and len(word) > 2:
            taken.add(word)
            words.append(word)
    return words


class SyntheticLanguagePair:
    """The lexicon (fixed by `lexicon_seed`) and a sentence-pair sampler."""

    def __init__(self, lexicon_seed=1234, nouns=120, adjectives=60, transitive=50, intransitive=30):
        rng = np.random.default_rng(lexicon_seed)
        taken_source = {"the", "a", "and", *PREPOSITIONS}
        taken_target = {"und", *PREPOSITIONS.values(), *ARTICLES.values()}

        def pairs(count):
            return list(
                zip(
                    _words(rng, count, SOURCE_SYLLABLES, SOURCE_VOWELS, taken_source),
                    _words(rng, count, TARGET_SYLLABLES, TARGET_VOWELS, taken_target),
                )
            )

        self.nouns = [(s, t, GENDERS[rng.integers(3)]) for s, t in pairs(nouns)]
        self.adjectives = pairs(adjectives)
        self.transitive = pairs(transitive)
        self.intransitive = pairs(intransitive)

    def _noun_phrase(self, rng, case, max_adjectives=2):
        source_noun, target_noun, gender = self.nouns[rng.integers(len(self.nouns))]
        plural = rng.random() < 0.3
        definite = rng.random() < 0.6
        adjectives = [
            self.adjectives[i]
            for i in rng.integers(len(self.adjectives), size=rng.integers(max_adjectives + 1))
        ]
        agreement = "pl" if plural else gender
        source = [] if plural and not definite else ["the" if definite else "a"]
        source += [s for s, _ in adjectives] + [source_noun + ("s" if plural else "")]
        target = [] if plural and not definite else [ARTICLES[(definite, agreement, case)]]
        target += [t + ADJECTIVE_ENDINGS[agreement] for _, t in adjectives]
        target += [target_noun + ("en" if plural else "")]
        return source, target, plural

    def _clause(self, rng):
        subject_source, subject_target, plural = self._noun_phrase(rng, "nom")
        if rng.random() < 0.7:
            verb_source, verb_target = self.transitive[rng.integers(len(self.transitive))]
            object_source, object_target, _ = self._noun_phrase(rng, "acc")
        else:
            verb_source, verb_target = self.intransitive[rng.integers(len(self.intransitive))]
            object_source, object_target = [], []
        phrase_source, phrase_target = [], []
        if rng.random() < 0.4:
            preposition = list(PREPOSITIONS)[rng.integers(len(PREPOSITIONS))]
            noun_source, noun_target, _ = self._noun_phrase(rng, "dat", max_adjectives=1)
            phrase_source = [preposition] + noun_source
            phrase_target = [PREPOSITIONS[preposition]] + noun_target
        source = subject_source + [verb_source + ("" if plural else "s")] + object_source + phrase_source
        target = subject_target + object_target + phrase_target + [verb_target + ("en" if plural else "t")]
        return source, target

    def sample(self, rng):
        """One (source, target) sentence pair of 3 to 25 words."""
        while True:
            source, target = self._clause(rng)
            if rng.random() < 0.35:
                second_source, second_target = self._clause(rng)
                source, target = source + ["and"] + second_source, target + ["und"] + second_target
            if 3 <= len(source) <= 25:
                return " ".join(source), " ".join(target)

    def corpus(self, sizes, seed=0):
        """Disjoint splits: `{name: (sources, targets)}` with `sizes = {name: count}`."""
        rng = np.random.default_rng(seed)
        seen, splits = set(), {}
        for name, count in sizes.items():
            sources, targets = [], []
            while len(sources) < count:
                source, target = self.sample(rng)
                if source not in seen:
                    seen.add(source)
                    sources.append(source)
                    targets.append(target)
            splits[name] = (sources, targets)
        return splits
