"""A small built-in English corpus, so that text prompts need no dataset download: passages for the grounded
workload come from it, and random text prompts draw their words from its vocabulary."""

from __future__ import annotations

import re

CORPUS = """\
The lighthouse on the northern cape was built of grey stone carried up from the beach by hand. For nearly a century \
a keeper climbed its spiral stairs every evening to trim the wick and wind the clockwork that turned the great lens. \
Ships far out at sea counted the flashes to learn which light they were looking at, and from that they knew how far \
they were from the rocks. Today the lamp is electric and the keeper's cottage is a small museum, but the light still \
turns every night, and fishermen still say they feel safer when they see it.

Baking bread at home takes patience more than skill. Flour, water, salt and yeast are mixed into a rough dough, which \
is left to rest so that the flour can absorb the water. After the rest the dough is folded a few times, and it slowly \
becomes smooth and elastic. A long, cool rise gives the yeast time to build flavour. When the loaf finally goes into a \
hot oven, steam helps the crust stay soft long enough for the bread to expand, and then it turns brown and crisp.

Rivers shape the land more than almost anything else. Over thousands of years a river cuts a valley, carries sand and \
stone towards the sea, and drops them where the water slows down. Floods spread fine mud across the plains, which is \
why so many farms and cities grew up beside rivers. Engineers now build walls and channels to control the water, yet \
every few years a great flood reminds people that the river was there first.

The old library in the town square opens at nine and closes at six. Its reading room has tall windows, long wooden \
tables and green lamps that the children are not allowed to switch off. Volunteers sort the returned books every \
morning and put them back on the shelves by number. On Saturdays a retired teacher reads stories aloud, and the room \
fills with families who come as much for the quiet as for the books.

A good map leaves things out. A subway map does not show the true distance between stations, because travellers only \
need to know the order of the stops and where the lines meet. A hiking map shows every contour and stream but ignores \
most buildings. Choosing what to leave out is the real work of the map maker, and a map that tries to show everything \
is usually hard to read.

Bees find their way home by remembering the position of the sun and the shapes of the land around the hive. When a \
worker finds a rich patch of flowers, she returns and performs a short dance on the comb. The angle of the dance tells \
the other bees which direction to fly, and its length tells them how far to go. In this way a whole colony can send \
its foragers to the best flowers within a few hours.

Learning a musical instrument is mostly a matter of small daily habits. Ten minutes of slow, careful practice every \
day does more than two hours once a week. Playing a passage slowly lets the hands learn the right movements before \
they learn the wrong ones. Recording yourself is uncomfortable at first, but it shows mistakes that are hard to hear \
while you are playing, and it makes progress easy to see after a month.

The first trains were slow, noisy and dangerous, and many people believed that travelling at thirty miles an hour \
would harm the human body. Within a few decades railways crossed whole continents. Towns that the line passed through \
grew quickly, while towns that it missed often faded away. Railway companies even changed how people kept time, \
because a train timetable only works when every station agrees on what time it is.
"""

PARAGRAPHS = [p.replace("\n", " ").strip() for p in CORPUS.split("\n\n") if p.strip()]
WORDS = " ".join(PARAGRAPHS).split()  # with punctuation, in order: passages are windows of this
VOCABULARY = sorted({w for w in re.findall(r"[a-z]+", " ".join(PARAGRAPHS).lower()) if len(w) > 1})
# Indices into WORDS where a sentence starts, so that passages begin cleanly.
SENTENCE_STARTS = [0] + [i + 1 for i, w in enumerate(WORDS[:-1]) if w.endswith(".")]
