"""The demo's chats: six document-based conversations with fixed English text.

Each opens with a long user message (a document and a request about it, about 300 SmolLM2 tokens
with the shared system prompt), then asks short follow-ups: `Script`s for
`kvtier.bench.multiturn.conversation.Conversation`, whose user messages they fix instead of the
generated report text. `kvtier demo` serves them one request at a time, turn 1 of every chat
first, so each chat's prefix has to survive every other chat's turn before it is asked again.
"""

from __future__ import annotations

from kvtier.bench.multiturn.conversation import Script

CHATS: tuple[Script, ...] = (
    Script(
        "lighthouse",
        "Here is the start of a short story I am writing. The lighthouse keeper had lived on the "
        "island for thirty years, and in all that time he had never once missed lighting the lamp at "
        "dusk. Every evening he climbed the spiral staircase, one hundred and twelve steps, carrying "
        "a can of oil and a cloth to polish the great lens. The fishermen in the village across the "
        "bay set their clocks by the first flash of his light. His wife had died young, and his only "
        "company was a grey cat that slept on the warm brass housing of the lamp. Once a month a boat "
        "brought flour, coffee, paraffin and letters from his sister in the city, who begged him every "
        "time to retire and come to live with her. One autumn night, a storm rolled in from the west, "
        "heavier than any he could remember. The wind tore shingles from the roof of his cottage and "
        "the waves broke over the rocks below the tower. Just before midnight he saw, far out beyond "
        "the reef, the lights of a small ship that seemed to be drifting towards the rocks. Can you "
        "suggest how the story should continue?",
        ("What could the keeper do to warn the ship, given what he has on the island?",
         "Should the sister appear later in the story? Suggest one scene with her.",
         "Give the story a title and explain your choice in one sentence.",
         "Rewrite the first sentence of the story so that it sounds more dramatic."),
    ),
    Script(
        "bread",
        "I found this recipe in my grandmother's notebook and I would like to understand it. A "
        "simple country bread begins the night before baking. Mix a spoonful of yeast with warm "
        "water and a cup of flour, cover the bowl with a damp towel, and leave it on the kitchen "
        "counter until morning. By then the starter will be bubbly and smell slightly sour. Add the "
        "rest of the flour, a generous pinch of salt, and enough water to make a soft dough. Knead it "
        "on a floured board for ten minutes, until it feels smooth and springs back when pressed. Let "
        "it rise in a warm place until it doubles in size, which takes about two hours in summer and "
        "longer in winter. Shape it into a round loaf, dust it with flour, and slash the top with a "
        "sharp knife. Bake it in a very hot oven with a tray of water on the bottom shelf for the "
        "first fifteen minutes, then lower the heat and bake until the crust is dark and the loaf "
        "sounds hollow when tapped underneath. My grandmother wrote in the margin that the bread "
        "keeps for three days wrapped in a linen cloth. Why does the recipe start the night before?",
        ("What is the tray of water in the oven for?",
         "How can I tell that the dough has risen enough if my kitchen is cold?",
         "Could I use whole wheat flour instead? What would change?",
         "Summarise the whole recipe as a short list of steps."),
    ),
    Script(
        "library",
        "Please help me prepare for a committee meeting. The committee met on Tuesday to review "
        "the proposed budget for the new public library. The architect presented three designs: a "
        "glass pavilion facing the river, a renovated brick warehouse near the train station, and a "
        "compact two-storey building on the site of the old market. Each design came with a "
        "different estimate for construction, heating, and staffing over the first ten years. The "
        "pavilion was the most expensive to build but the cheapest to light, the warehouse was the "
        "cheapest to build but needed a new roof within a decade, and the market building was in the "
        "middle on every count. Several members worried that the glass pavilion would be expensive "
        "to cool in summer, while others argued that the warehouse lacked space for a children's "
        "reading room. A local bookseller pointed out that the market site is the only one on a bus "
        "route used by the two secondary schools. The chair asked for written comments by Friday, "
        "and the treasurer promised a detailed comparison of the long-term costs before the next "
        "meeting in March. What are the main arguments for each design?",
        ("Which design would you recommend for families with young children, and why?",
         "What questions should I ask the treasurer before the March meeting?",
         "Draft a short written comment for Friday supporting the market site.",
         "What risks does the warehouse option carry over ten years?"),
    ),
    Script(
        "birds",
        "I am reading about bird migration for a school project. Migratory birds navigate "
        "thousands of kilometres each year using a combination of cues. Young birds inherit a "
        "general direction and distance from their parents, but they refine their routes with "
        "experience. During the day many species use the position of the sun, compensating for its "
        "movement across the sky with an internal clock. At night they read the patterns of the "
        "stars around the celestial pole, which young birds learn by watching the sky rotate during "
        "their first summer. Some birds can also sense the Earth's magnetic field, perhaps through "
        "specialised cells in their eyes or beaks. Landmarks such as coastlines, mountain ranges and "
        "rivers help them correct their course as they approach familiar territory, and smells may "
        "guide seabirds back to their nesting colonies. Experiments with displaced birds show that "
        "adults can correct for being moved hundreds of kilometres, while young birds simply keep "
        "flying in their inherited direction and end up in the wrong place. Explain the difference "
        "between how young and adult birds navigate.",
        ("How do birds know the time of day to use the sun as a compass?",
         "What would happen to a bird that relies on the stars on a cloudy night?",
         "Suggest a simple experiment a school class could do about this topic.",
         "Write two sentences that could end my project report."),
    ),
    Script(
        "railway",
        "Our village is writing a leaflet about a walking trail. When the old railway line closed "
        "in the nineteen sixties, the tracks were lifted and the embankments slowly disappeared "
        "under brambles and young birch trees. Decades later, a group of volunteers began clearing a "
        "path along the route, hoping to connect the three villages that the trains once served. "
        "They rebuilt two footbridges, drained the flooded cutting near the quarry, and planted "
        "hedges of hawthorn and hazel along the edges. The work took eleven years of weekends and "
        "was paid for by a bakery sale every spring and a small grant from the county council. Today "
        "the trail is used by walkers, cyclists and children on their way to school, and an old "
        "signal box has been restored as a small museum where visitors can see photographs of the "
        "steam engines that once thundered through the valley. Barn owls nest in the old goods shed, "
        "and in May the cutting is full of bluebells. Write an opening paragraph for the leaflet.",
        ("Add a short section about the volunteers and how the work was paid for.",
         "What safety advice should the leaflet give to cyclists?",
         "Suggest three things children could look for along the trail.",
         "Write a closing sentence inviting visitors to the signal box museum."),
    ),
    Script(
        "garden",
        "I have just moved into a house with a small garden and I want to grow vegetables. "
        "Planting a vegetable garden starts with choosing a sunny spot that drains well after rain. "
        "Dig the soil to the depth of a spade, remove stones and roots, and mix in a thick layer of "
        "compost. Tomatoes, beans and courgettes like warmth, so wait until the last frost has passed "
        "before sowing them outside. Lettuce, radishes and peas prefer cooler weather and can go in "
        "early in spring. Water in the morning rather than the evening, and cover the beds with "
        "straw to keep the moisture in. Rotate the crops every year so that the same family does "
        "not grow in the same bed twice in a row, which keeps soil diseases down. A neighbour told "
        "me that marigolds planted between the rows keep some insects away and that a shallow dish "
        "of beer will catch slugs overnight. The garden faces south, the soil is heavy clay, and "
        "there is a water butt by the shed. Which vegetables should I start with in my first year?",
        ("How should I improve heavy clay soil before planting?",
         "Is the advice about marigolds and beer traps reliable?",
         "Make a simple month-by-month plan for spring.",
         "What can I grow in pots near the house if the beds are not ready?"),
    ),
)


def max_turns() -> int:
    """The most turns every chat has text for."""
    return 1 + min(len(c.followups) for c in CHATS)


def check_sizes(conversations: int, turns: int) -> None:
    """Raise ValueError (naming the flag and the value) unless the chats have that much text."""
    if not 1 <= conversations <= len(CHATS):
        raise ValueError(f"--conversations {conversations}: must be between 1 and {len(CHATS)}")
    if not 1 <= turns <= max_turns():
        raise ValueError(f"--turns {turns}: must be between 1 and {max_turns()}")
