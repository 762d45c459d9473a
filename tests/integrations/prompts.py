"""Real English prompts for the vLLM tests (about 120-140 SmolLM2 tokens each: 3-4 chunks of 32)."""

PROMPTS = {
    "lighthouse": (
        'The lighthouse keeper had lived on the island for thirty years, and in all that time he had '
        'never once missed lighting the lamp at dusk. Every evening he climbed the spiral staircase, one '
        'hundred and twelve steps, carrying a can of oil and a cloth to polish the great lens. The '
        'fishermen in the village across the bay set their clocks by the first flash of his light. One '
        'autumn night, a storm rolled in from the west, heavier than any he could remember. The wind tore'
        ' shingles from the roof of his cottage and the waves broke over the rocks below the tower. Write'
        ' the next paragraph of the story.'
    ),
    "bread": (
        'A recipe for a simple country bread begins the night before baking. Mix a spoonful of yeast with'
        ' warm water and a cup of flour, cover the bowl with a damp towel, and leave it on the kitchen '
        'counter until morning. By then the starter will be bubbly and smell slightly sour. Add the rest '
        'of the flour, a generous pinch of salt, and enough water to make a soft dough. Knead it on a '
        'floured board for ten minutes, until it feels smooth and springs back when pressed. Let it rise '
        'in a warm place until it doubles in size. Explain what to do next.'
    ),
    "library": (
        'The committee met on Tuesday to review the proposed budget for the new public library. The '
        'architect presented three designs: a glass pavilion facing the river, a renovated brick '
        'warehouse near the train station, and a compact two-storey building on the site of the old '
        'market. Each design came with a different estimate for construction, heating, and staffing over '
        'the first ten years. Several members worried that the glass pavilion would be expensive to cool '
        "in summer, while others argued that the warehouse lacked space for a children's reading room. "
        'The chair asked for written comments by Friday, and the treasurer promised a detailed comparison'
        ' of the long-term costs before the next meeting in March.'
    ),
    "birds": (
        'Migratory birds navigate thousands of kilometres each year using a combination of cues. Young '
        'birds inherit a general direction and distance from their parents, but they refine their routes '
        'with experience. During the day many species use the position of the sun, compensating for its '
        'movement across the sky with an internal clock. At night they read the patterns of the stars '
        "around the celestial pole. Some birds can also sense the Earth's magnetic field, perhaps through"
        ' specialised cells in their eyes or beaks. Landmarks such as coastlines, mountain ranges and '
        'rivers help them correct their course as they approach familiar territory, and smells may guide '
        'seabirds back to their nesting colonies.'
    ),
    "railway": (
        'When the old railway line closed in the nineteen sixties, the tracks were lifted and the '
        'embankments slowly disappeared under brambles and young birch trees. Decades later, a group of '
        'volunteers began clearing a path along the route, hoping to connect the three villages that the '
        'trains once served. They rebuilt two footbridges, drained the flooded cutting near the quarry, '
        'and planted hedges of hawthorn and hazel along the edges. Today the trail is used by walkers, '
        'cyclists and children on their way to school, and an old signal box has been restored as a small'
        ' museum where visitors can see photographs of the steam engines that once thundered through the '
        'valley.'
    ),
    "chess": (
        'The chess club at the community centre meets every Thursday evening. Beginners sit at the long '
        'table by the window, where two retired teachers explain how each piece moves and why controlling'
        ' the centre of the board matters so much in the opening. Stronger players gather in the back '
        'room to analyse famous games, replaying the moves on a magnetic board and arguing about missed '
        'opportunities. Once a month the club holds a rapid tournament with fifteen minutes per player, '
        "and the winner's name is written on a chalkboard beside the coffee machine. Last winter a nine-"
        'year-old girl won three tournaments in a row, and the older members still talk about her bold '
        'sacrifices.'
    ),
    "garden": (
        'Planting a vegetable garden starts with choosing a sunny spot that drains well after rain. Dig '
        'the soil to the depth of a spade, remove stones and roots, and mix in a thick layer of compost. '
        'Tomatoes, beans and courgettes like warmth, so wait until the last frost has passed before '
        'sowing them outside. Lettuce, radishes and peas prefer cooler weather and can go in early in '
        'spring. Water in the morning rather than the evening, and cover the beds with straw to keep the '
        'moisture in. Describe how to keep slugs away from the young plants.'
    ),
}
